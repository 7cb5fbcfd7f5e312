"""Speculative decoding: draft sources (draft_model, mtp, ngram), one verifier, the settings that pick them
(config), the draft policy and the rollback; what a request's speculation did is `engine.request.SpecStats`."""
