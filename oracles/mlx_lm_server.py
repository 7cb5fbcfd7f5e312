"""Stock `mlx_lm.server`, with exactly three additions a benchmark needs, and nothing else changed.

    python -m oracles.mlx_lm_server --model DIR --port N [any mlx_lm.server option]

1. `prompt` may be a list of token ids on /v1/completions (stock mlx-lm 0.32.2
   answers such a request with a tokenizer error): the ids are used as the
   tokenized prompt, as if the text had tokenized to them.
2. `ignore_eos: true` gives a fixed output length: the request's `logit_bias`
   gets -1e9 on every EOS id, through mlx-lm's own logits processor (no EOS
   can be sampled; every other logit is untouched, so greedy tokens are the
   same until the point where stock mlx-lm would have stopped).
3. A listen backlog of `BACKLOG` connections: its `ThreadingHTTPServer` keeps
   socketserver's 5, so of 65 requests sent at once (the harness's warmup
   phase at 64 streams) about one in five had its connection reset before
   mlx-lm saw it.

Everything else (scheduling, batching, sampling, caching, SSE) is stock
`mlx_lm.server.main()`. The harness records this command line as the arm's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EOS_BIAS = -1e9
BACKLOG = 1024


def _eos_ids(model_dir: str) -> list[int]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return sorted(load_tokenizer(Path(model_dir)).eos_token_ids)


def patch(eos_ids: list[int]) -> None:
    from mlx_lm import server

    tokenize = server.ResponseGenerator._tokenize

    def _tokenize(self, tokenizer, request, args):
        p = request.prompt
        if request.request_type == "text" and isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            return list(p), [list(p)], ["assistant"], "normal", None
        return tokenize(self, tokenizer, request, args)

    validate = server.APIHandler.validate_model_parameters

    def validate_model_parameters(self):
        validate(self)
        if self.body.get("ignore_eos") is True:
            self.logit_bias = {**(self.logit_bias or {}), **{e: EOS_BIAS for e in eos_ids}}

    server.ResponseGenerator._tokenize = _tokenize
    server.APIHandler.validate_model_parameters = validate_model_parameters
    server.ThreadingHTTPServer.request_queue_size = BACKLOG


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", required=True)
    known, _ = parser.parse_known_args()
    patch(_eos_ids(known.model))
    from mlx_lm import server

    sys.argv = ["mlx_lm.server", *sys.argv[1:]]
    server.main()


if __name__ == "__main__":
    main()
