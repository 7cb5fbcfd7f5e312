"""Speculative decoding: draft sources (draft_model, mtp, ngram), one verifier, the settings that pick them
(config), the draft policy, the rollback, and what a request's speculation did (stats)."""
