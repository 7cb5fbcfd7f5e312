"""`harness spec`: arms, blocks, records; a real (tiny) run end to end."""

import json

import pytest

from harness.bench.spec import PLAIN, SpecArm, SpecBenchConfig, markdown, parse_arms, run_spec_bench
from harness.cli import main as harness_main


def test_arms_parse_with_plain_first_and_refuse_unknown_names():
    arms = parse_arms("self,draft:tiny-qwen35-draft,ngram,mtp", "tiny-qwen35")
    assert [a.name for a in arms] == [PLAIN, "self", "draft:tiny-qwen35-draft", "ngram", "mtp"]
    assert arms[1] == SpecArm("self", "draft", "tiny-qwen35")
    assert arms[2].draft == "tiny-qwen35-draft" and arms[3].kind == "ngram"
    assert [a.name for a in parse_arms("plain,ngram", "x")] == [PLAIN, "ngram"]
    assert parse_arms("ngram-miss", "x")[1] == SpecArm("ngram-miss", "ngram", miss=True)
    with pytest.raises(ValueError, match="unknown arm 'medusa'"):
        parse_arms("medusa", "x")
    with pytest.raises(ValueError, match="named twice"):
        parse_arms("ngram,ngram", "x")


def test_a_tiny_run_records_every_arm_and_block():
    cfg = SpecBenchConfig(prompt_tokens=32, decode_tokens=12, blocks=2, warmup=0, num_draft=2)
    # f32: a verify window and a single step agree to the last bits, so the self-draft accepts everything.
    result = run_spec_bench("tiny-qwen35-f32", parse_arms("self,ngram,mtp", "tiny-qwen35-f32"), cfg)
    assert [a.arm for a in result.arms] == [PLAIN, "self", "ngram", "mtp"]
    for a in result.arms:
        assert len(a.decode_tps) == len(a.ttft_ms) == len(a.same_tokens) == 2
    rec = result.as_record()
    plain, self_draft = rec["arms"][0], rec["arms"][1]
    assert "paired" not in plain and plain["spec"] is None
    assert self_draft["spec"]["acceptance"] == 1.0  # the target agrees with itself
    assert self_draft["paired"]["verdict"] == "unknown" and "too few blocks" in self_draft["paired"]["note"]  # 2 blocks
    assert all(a["median_forward_ms"] > 0 for a in rec["arms"])
    md = markdown(result)
    assert "| self |" in md and "| plain |" in md and "| ms / target forward |" in md
    json.dumps(rec)


def test_the_cli_writes_json_and_markdown(tmp_path):
    out, md = tmp_path / "spec.json", tmp_path / "spec.md"
    code = harness_main(
        [
            "spec",
            "--model",
            "tiny-qwen3-f32",
            "--arms",
            "draft:tiny-qwen3-draft-f32,ngram",
            "--blocks",
            "1",
            "--prompt-tokens",
            "16",
            "--decode-tokens",
            "8",
            "--warmup",
            "0",
            "--json",
            str(out),
            "--md",
            str(md),
        ]
    )
    assert code == 0  # every arm's tokens equal plain's
    rec = json.loads(out.read_text())
    assert [a["arm"] for a in rec["arms"]] == [PLAIN, "draft:tiny-qwen3-draft-f32", "ngram"]
    assert md.read_text().startswith("# Speculative decoding vs plain: tiny-qwen3-f32")


def test_the_trained_pair_accepts_most_drafts_on_held_out_python(tmp_path):
    # The committed trained target and its draft: a draft model that learned the same text agrees with the
    # target's greedy choice most of the time (random weights: almost never), and greedy output is unchanged.
    out = tmp_path / "spec.json"
    code = harness_main(
        [
            "spec",
            "--model",
            "trained-qwen3",
            "--arms",
            "draft:trained-qwen3-draft,ngram",
            "--blocks",
            "2",
            "--prompt-tokens",
            "64",
            "--decode-tokens",
            "32",
            "--warmup",
            "0",
            "--num-draft",
            "1",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    rec = json.loads(out.read_text())
    assert rec["config"]["text"] == "held-out"
    draft = rec["arms"][1]["spec"]
    assert draft["acceptance"] >= 0.5, draft


def test_the_trained_hybrid_and_its_mtp_head_accept_most_drafts(tmp_path):
    # The committed hybrid target: its MTP head, trained beside it, and the dense family's draft both agree with
    # its greedy choice most of the time, and greedy output is unchanged (exact tier, trace rollback).
    out = tmp_path / "spec.json"
    code = harness_main(
        [
            "spec",
            "--model",
            "trained-qwen35",
            "--arms",
            "mtp,draft:trained-qwen3-draft",
            "--blocks",
            "2",
            "--prompt-tokens",
            "64",
            "--decode-tokens",
            "32",
            "--warmup",
            "0",
            "--num-draft",
            "2",
            "--json",
            str(out),
        ]
    )
    assert code == 0  # every arm's tokens equal plain's
    rec = json.loads(out.read_text())
    mtp, draft = (a["spec"] for a in rec["arms"][1:])
    assert mtp["acceptance"] >= 0.5 and draft["acceptance"] >= 0.5, (mtp, draft)


def test_concurrency_parses_a_list_of_row_counts():
    import argparse

    from harness.bench.cli import row_counts

    assert row_counts("1,4,8") == (1, 4, 8)
    assert row_counts("4") == (4,)
    for bad in ("0,4", "1,1", "a", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            row_counts(bad)


def test_a_tiny_concurrent_run_at_1_and_4_rows_pairs_spec_rows_with_plain_rows(tmp_path):
    from harness.bench.spec import record, run_concurrent_bench

    cfg = SpecBenchConfig(prompt_tokens=24, decode_tokens=10, blocks=2, warmup=0, num_draft=2, concurrency=(1, 4))
    seen = []  # after each block: (rows, blocks done) of each result so far, each one recordable then

    def on_results(so_far):
        seen.append([(c["rows"], len(c["seeds"])) for c in record(so_far)["concurrency"]])

    results = run_concurrent_bench("tiny-qwen3-f32", parse_arms("ngram", "tiny-qwen3-f32"), cfg, on_results=on_results)
    assert seen == [[(1, 1)], [(1, 2)], [(1, 2), (4, 1)], [(1, 2), (4, 2)]]
    assert [r.rows for r in results] == [1, 4]
    for r in results:
        assert [a.arm for a in r.arms] == [PLAIN, "ngram"]
        plain, ngram = r.arms
        assert len(plain.decode_tps) == len(ngram.same_tokens) == 2 and plain.spec is None
        assert len(ngram.row_spec) == 2 * r.rows  # every row of every block
        assert ngram.spec["rounds"] == sum(s["rounds"] for s in ngram.row_spec)
    for r in results:
        for a in r.arms:
            assert len(a.forward_ms) == 2 and all(ms > 0 for ms in a.forward_ms)
    rec = record(results)
    assert [c["rows"] for c in rec["concurrency"]] == [1, 4]
    assert "paired" in rec["concurrency"][1]["arms"][1]
    assert all(a["median_forward_ms"] > 0 for c in rec["concurrency"] for a in c["arms"])
    json.dumps(rec)
    md = markdown(results)
    assert "| rows | arm |" in md and "| 4 | ngram |" in md and "| 1 | plain |" in md
    assert "| ms / target forward |" in md


def test_draft_model_arms_run_as_spec_rows_at_1_and_4_rows():
    from harness.bench.spec import run_concurrent_bench

    cfg = SpecBenchConfig(prompt_tokens=24, decode_tokens=10, blocks=2, warmup=0, num_draft=2, concurrency=(1, 4))
    arms = parse_arms("self,draft:tiny-qwen3-draft-f32", "tiny-qwen3-f32")
    for r in run_concurrent_bench("tiny-qwen3-f32", arms, cfg):
        plain, self_draft, draft = r.arms
        assert all(self_draft.same_tokens) and all(draft.same_tokens)
        assert len(draft.row_spec) == 2 * r.rows and draft.spec["kind"] == "draft"
        assert self_draft.spec["acceptance"] == 1.0  # f32: the target agrees with itself in every row
        for a in (self_draft, draft):  # the group's verify windows and its draft's time, in every row's stats
            assert a.spec["windows"] > 0 and a.spec["ms_per_window"] > 0 and a.spec["draft_ms_per_round"] > 0


@pytest.mark.parametrize("concurrency", [(), (1,)])
def test_the_miss_arm_drafts_by_prompt_lookup_has_nothing_accepted_and_emits_plain_tokens(concurrency):
    from harness.bench.spec import run_concurrent_bench

    cfg = SpecBenchConfig(prompt_tokens=32, decode_tokens=32, blocks=2, warmup=0, num_draft=2, concurrency=concurrency)
    arms = parse_arms("ngram,ngram-miss", "tiny-qwen3-f32")
    result = (
        run_concurrent_bench("tiny-qwen3-f32", arms, cfg)[0]
        if concurrency
        else run_spec_bench("tiny-qwen3-f32", arms, cfg)
    )
    plain, ngram, miss = result.arms
    assert ngram.spec["accepted"] > 0  # the lookup finds drafts the target takes
    assert miss.spec["drafted"] > 0 and miss.spec["accepted"] == 0 and miss.spec["acceptance"] == 0
    assert all(miss.same_tokens) and all(ngram.same_tokens)
    assert "| ngram-miss |" in markdown(result)
    if concurrency:  # spec rows time their windows (prompt lookup drafts on the host: no draft time)
        assert miss.spec["windows"] > 0 and miss.spec["ms_per_window"] > 0 and miss.spec["draft_ms_per_round"] == 0
        assert "| ms / verify window | draft ms / round |" in markdown(result)
    else:  # the serial lane does not
        assert miss.spec["windows"] == 0 and miss.spec["ms_per_window"] is None


def test_the_cli_runs_concurrency_and_writes_one_record(tmp_path, monkeypatch):
    out, md = tmp_path / "spec.json", tmp_path / "spec.md"
    args = ["spec", "--model", "tiny-qwen3-f32", "--arms", "plain,ngram", "--blocks", "1", "--prompt-tokens", "16"]
    args += ["--decode-tokens", "8", "--warmup", "0", "--concurrency", "1,2", "--json", str(out), "--md", str(md)]
    args += ["--kernels", "exact", "--kernel-cache-dir", str(tmp_path / "kernels")]
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "")  # the option sets it for the process: undone after the test
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    assert harness_main(args) in (0, 1)  # 1 only if a row's tokens differ from plain's
    assert (tmp_path / "kernels").is_dir()
    rec = json.loads(out.read_text())
    assert [c["rows"] for c in rec["concurrency"]] == [1, 2]
    assert rec["config"]["kernels"] == "exact" and rec["kernels"] == "exact"
    assert all(a["median_forward_ms"] > 0 for c in rec["concurrency"] for a in c["arms"])
    text = md.read_text()
    assert "| 2 | ngram |" in text and "exact kernels" in text.splitlines()[0]
    assert "| ms / target forward |" in text


def test_first_difference_names_the_earliest_token_any_row_differs_at():
    from harness.bench.spec import first_difference

    assert first_difference([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) is None
    assert first_difference([[1, 2, 3], [4, 9]], [[1, 7, 3], [4, 5]]) == 1
    assert first_difference([[1, 2]], [[1, 2, 3]]) == 2  # a shorter row differs where it ends
