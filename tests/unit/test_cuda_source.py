"""The kernels' sources as MLX gets them: compacted, the same code token for token."""

import re

import pytest

from engine.kernels import attention_step, gated_delta_step
from engine.kernels import quantized_gemv as qg
from engine.kernels.cuda_source import compact
from engine.kernels.quantized_gemv.source import HEADER as GEMV_HEADER

# C++ tokens, each alternative whole: literals first, so that quotes and slashes inside them stay theirs
_TOKEN = re.compile(
    r'"(?:\\.|[^"\\])*"'
    r"|'(?:\\.|[^'\\])*'"
    r"|(?P<comment>//[^\n]*|/\*.*?\*/)"
    r"|(?P<space>\s+)|\w+|.",
    re.S,
)


def tokens(source: str) -> list[str]:
    return [m.group() for m in _TOKEN.finditer(source) if not (m.group("comment") or m.group("space"))]


def preprocessor_lines(source: str) -> list[str]:
    return [" ".join(tokens(line)) for line in source.splitlines() if line.lstrip().startswith("#")]


def engine_sources() -> dict[str, str]:
    fusions = [
        qg.Fusion(),
        qg.Fusion(residual=True, norm_out=True),
        qg.Fusion(gated=True),
        qg.Fusion(prenormed=True),
        qg.Fusion(norm_scale=True),
    ]
    sources = {
        f"gemv {count} {fusion.tag()}": qg.kernel_source(count, fusion)
        for count in (1, 2, 4)
        for fusion in fusions
        if not fusion.gated or count == 2
    }
    sources |= {
        "gemv header": GEMV_HEADER + qg.launch_bounds(128, 5),
        "delta step header": gated_delta_step.HEADER,
        "delta step": gated_delta_step.SOURCE,
        "attention header": attention_step.HEADER,
        "keys": attention_step.KEYS_SOURCE,
        "attend": attention_step.ATTEND_SOURCE,
        "partial": attention_step.PARTIAL_SOURCE,
        "merge": attention_step.MERGE_SOURCE,
    }
    return sources


@pytest.mark.parametrize("name, source", engine_sources().items())
def test_compacted_sources_keep_every_token(name, source):
    # What the compiler reads is unchanged: the same tokens (string literals included), and each
    # preprocessor directive still a line of its own; what goes is comments and indentation.
    small = compact(source)
    assert tokens(small) == tokens(source)
    assert preprocessor_lines(small) == preprocessor_lines(source)
    assert "//" not in "".join(t for t in tokens(small) if not t.startswith('"')) and len(small) < len(source)
    assert small == compact(small)


def test_compact_leaves_literals_alone():
    source = '  x = "a // b";  // note\n\n  c = \'/\'; d = "\\"//"; // e\n#define K 4  // k-tiles\n'
    assert compact(source) == 'x = "a // b";\nc = \'/\'; d = "\\"//";\n#define K 4\n'
