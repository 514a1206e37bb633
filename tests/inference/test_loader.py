import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from inference.loader import file_sha256, load_model, permute_qk, resolve_model_path, unpermute_qk
from tests.inference.helpers import greedy, make_engine


def test_gguf_and_hf_directory_of_the_same_weights_give_the_same_tokens(tiny_paths):
    gguf_model, hf_model = load_model(tiny_paths["gguf"]), load_model(tiny_paths["hf"])
    for name, w in hf_model.weights.items():
        assert torch.equal(gguf_model.weights[name], w), name  # Q/K un-permuted exactly
    prompt = gguf_model.tokenizer.encode_chat([{"role": "user", "content": "the cat in the hat"}])
    assert prompt == hf_model.tokenizer.encode_chat([{"role": "user", "content": "the cat in the hat"}])
    a = make_engine(gguf_model).generate([prompt], greedy(12))[0].output_ids
    b = make_engine(hf_model).generate([prompt], greedy(12))[0].output_ids
    assert a == b


def test_quantized_gguf_dequantizes_close_to_the_float_weights(tiny_paths):
    exact, q8 = load_model(tiny_paths["gguf"]), load_model(tiny_paths["gguf_q8"])
    w, wq = exact.weights["model.layers.0.mlp.up_proj.weight"], q8.weights["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(w, wq) and torch.allclose(w, wq, atol=w.abs().max().item() / 100)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_gguf_quant_round_trip(qtype):
    import gguf

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    back = gguf.quants.dequantize(gguf.quants.quantize(w, t), t)
    assert back.shape == w.shape and np.abs(back - w).max() < 0.25 * np.abs(w).max()


def test_qk_permutation_round_trips():
    w = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)
    assert np.array_equal(unpermute_qk(permute_qk(w, 3), 3), w)
    assert not np.array_equal(permute_qk(w, 3), w)


def test_converted_weights_are_cached_by_file_hash(tiny_paths, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    load_model(tiny_paths["gguf"])
    (entry,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert entry.name.startswith(file_sha256([tiny_paths["gguf"]])[:24])
    stamp = (entry / "weights.safetensors").stat().st_mtime_ns
    load_model(tiny_paths["gguf"])
    assert (entry / "weights.safetensors").stat().st_mtime_ns == stamp  # read, not converted again


def test_missing_model_names_the_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_MODEL", str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="KVSERVE_MODEL"):
        resolve_model_path()


def test_default_model_comes_from_the_installed_wheel(monkeypatch):
    monkeypatch.delenv("KVSERVE_MODEL", raising=False)
    assert resolve_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_tokenizer_and_chat_template_match_the_reference_ids(real_model):
    tok = real_model.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    # transformers' own GGUF tokenizer and template give these ids for the same message
    assert ids == [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
                   407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1,
                   520, 9531, 198]
    with_system = tok.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert "SmolLM" not in with_system and with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert tok.decode(tok.encode("naïve café 123 — ok")) == "naïve café 123 — ok"


def test_cli_prints_only_the_greedy_reply():
    out = subprocess.run([sys.executable, "-m", "inference", "chat", "What is the capital of France?"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert out.stdout == "The capital of France is Paris.\n"


CONVERT_AND_MEASURE = """
import json
from inference.memory import process_memory
import torch  # noqa: F401  (its own memory is not the conversion's)
before = process_memory()
from inference.loader import load_model
load_model()
after = process_memory()
print(json.dumps({k: after[k] - before[k] for k in ("VmRSS", "RssAnon")}))
"""


@pytest.mark.timeout(300)
def test_converting_the_gguf_leaves_no_dequantized_copy_in_the_heap(tmp_path):
    """First start converts the GGUF (0.5 GB of fp32 arrays); afterwards the process holds only the mmapped
    cache file, not the freed arrays glibc would otherwise keep (~0.4 GB)."""
    out = subprocess.run([sys.executable, "-c", CONVERT_AND_MEASURE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "KVSERVE_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    grown = json.loads(out.stdout.strip().splitlines()[-1])
    assert grown["RssAnon"] < 150 * 2**20, grown


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_a_gguf_s_4bit_blocks_are_read_as_its_own_codes(tmp_path, qtype):
    """The codes, scales and zeros int4w multiplies dequantize to exactly the weights load_model dequantized
    (gguf's own reader), q/k rows un-permuted alike; other quant types hold no groups."""
    from inference.loader import gguf_group_weights, gguf_has_group_weights
    from inference.tiny import tiny_weights, write_gguf

    weights, c = tiny_weights()
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", weights, c, qtype)
    loaded, groups = load_model(path), gguf_group_weights(path)
    projections = [n for n in loaded.weights if n.startswith("model.layers.") and n.endswith("proj.weight")]
    assert sorted(groups) == sorted(projections) and len(projections) == 7 * c["layers"]
    for name in projections:
        assert torch.equal(groups[name].dequantize(), loaded.weights[name]), name
        assert groups[name].q.dtype == torch.uint8 and int(groups[name].q.max()) <= 15
    assert gguf_has_group_weights(path)
    assert gguf_group_weights(path).keys() == groups.keys()  # the second read is the cache entry's


def test_a_gguf_s_q8_0_blocks_are_read_as_its_own_codes(tiny_paths, real_model):
    """w4a8's int8 codes and scales dequantize to exactly what load_model dequantized: the tiny Q8_0 file's
    projections (q/k rows un-permuted alike) and the real model's tied token_embd (its lm_head)."""
    from inference.loader import gguf_group8_weights

    loaded, groups = load_model(tiny_paths["gguf_q8"]), gguf_group8_weights(tiny_paths["gguf_q8"])
    projections = [n for n in loaded.weights if n.startswith("model.layers.") and n.endswith("proj.weight")]
    assert sorted(groups) == sorted(projections)
    for name in projections:
        assert groups[name].q.dtype == torch.int8 and torch.equal(groups[name].dequantize(), loaded.weights[name]), name
    real = gguf_group8_weights(real_model.source)
    assert list(real) == ["model.embed_tokens.weight"]
    assert torch.equal(real["model.embed_tokens.weight"].dequantize(), real_model.weights["model.embed_tokens.weight"])
    assert gguf_group8_weights(tiny_paths["gguf"]) == {} and gguf_group8_weights(tiny_paths["hf"]) == {}


def test_only_4bit_block_files_have_groups(tiny_paths):
    from inference.loader import gguf_group_weights, gguf_has_group_weights

    for kind in ("gguf", "gguf_q8", "hf"):
        assert not gguf_has_group_weights(tiny_paths[kind]) and gguf_group_weights(tiny_paths[kind]) == {}


def test_the_real_model_s_projections_are_all_q4_1_codes(real_model):
    from inference.loader import gguf_group_weights

    groups = gguf_group_weights(real_model.source)
    assert len(groups) == 7 * real_model.config.num_layers
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        assert torch.equal(groups[name].dequantize(), real_model.weights[name])
