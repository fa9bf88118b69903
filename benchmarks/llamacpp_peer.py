"""llama.cpp as a peer: GGUF files written from a model directory's safetensors, timed in a process of its own.

Runs under .venv-llamacpp's python (`make bench-llamacpp-peer`: llama-cpp-python compiled for this CPU, and
gguf-py), which has no torch and no runner_core, so this file imports only the standard library at the top.
  --write        the GGUF file of one type: f32, bf16, q8_0 or q4_0 (gguf-py's quants module quantizes every
                 2-D weight, token embedding and output included; norms stay F32); llama and qwen2
                 architectures (llama's q/k rows permuted to llama.cpp's rotary layout; llama3 rope scaling
                 as its rope_freqs factors); the tokenizer's byte-level BPE vocabulary and merges
  --serve        load one GGUF (weights read into memory, no mmap) and speak benchmarks/child.py's protocol,
                 like benchmarks/quant_proc.py: the start-up reply (load_s, peak_rss_mib, rss_mib,
                 weights_bytes = the file's tensor bytes, read_bytes, and against the float32 reference
                 .npz the logit error and greedy agreement), then "batch1" (greedy from a 32-token prompt,
                 1 and 1 + N tokens) and "quit"
From our venv, `python benchmarks/llamacpp_peer.py --model small-llama` resolves the preset's directory
(runner_core.loader.model_loader.resolve_model_path), writes the files into build/gguf/ when missing and prints
each type's batch-1 tok/s (the figures beside ours come from benchmarks/quant.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-llamacpp" / "bin" / "python"
GGUF_DIR = ROOT / "build" / "gguf"
TYPES = ("f32", "q8_0", "q4_0")
ALL_TYPES = ("f32", "bf16", "q8_0", "q4_0")
BATCH1_PROMPT = 32
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


# ---- the driver's side (our venv) -------------------------------------------------------------------
def available() -> bool:
    return PYTHON.exists()


def gguf_path(model_dir: str, gtype: str) -> Path:
    return GGUF_DIR / f"{Path(model_dir).name}-{gtype}.gguf"


def ensure_gguf(model_dir: str, gtype: str) -> Path:
    """The GGUF file of `gtype`, written first (in .venv-llamacpp) when it is not there yet."""
    import subprocess

    path = gguf_path(model_dir, gtype)
    if not path.exists():
        GGUF_DIR.mkdir(parents=True, exist_ok=True)
        print(f"  writing {path.name} ...", flush=True)
        subprocess.run([str(PYTHON), __file__, "--write", "--model-dir", model_dir, "--type", gtype,
                        "--out", str(path)], check=True)
    return path


def start(model_dir: str, gtype: str, tmp: Path, args):
    """A serving llama.cpp process on `gtype`'s GGUF (benchmarks/child.py's Child)."""
    try:
        import child
    except ImportError:
        from benchmarks import child

    if not available():
        raise child.ChildFailed(f"no llama.cpp venv at {PYTHON.parent.parent}: run make bench-llamacpp-peer")
    path = ensure_gguf(model_dir, gtype)
    cmd = [str(PYTHON), __file__, "--serve", "--gguf", str(path), "--threads", str(args.threads),
           "--decode-tokens", str(args.decode_tokens), "--ref", str(tmp / "ref.npz")]
    return child.Child(f"llama.cpp {gtype}", cmd, tmp / f"llama.cpp-{gtype}.log", args.timeout)


# ---- writing GGUF (.venv-llamacpp) ------------------------------------------------------------------
def read_safetensors(model_dir: Path):
    """{name: float32 numpy array} of every *.safetensors file (F32, F16 and BF16 tensors)."""
    import numpy as np

    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            begin, end = meta["data_offsets"]
            data = raw[begin:end]
            if meta["dtype"] == "BF16":
                arr = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            elif meta["dtype"] in ("F32", "F16"):
                arr = data.view(np.float32 if meta["dtype"] == "F32" else np.float16).astype(np.float32)
            else:
                raise ValueError(f"{path.name}: tensor {name} is {meta['dtype']}; only F32, F16 and BF16 are read")
            out[name] = arr.reshape(meta["shape"])
    if not out:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return out


def gguf_name(hf: str) -> str | None:
    if hf in _TOP:
        return _TOP[hf]
    parts = hf.split(".")
    if parts[:2] != ["model", "layers"]:
        return None
    stem, kind = ".".join(parts[3:-1]), parts[-1]
    return f"blk.{parts[2]}.{_LAYER[stem]}.{kind}" if stem in _LAYER else None


def permute_rows(w, heads: int):
    """HF's rotary halves (rotate_half) to llama.cpp's interleaved pairs, for the llama architecture's q and k."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict, head_dim: int):
    import numpy as np

    theta, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def add_tokenizer(writer, model_dir: Path, vocab_size: int, config: dict) -> None:
    import gguf

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    if tok["model"]["type"] != "BPE":
        raise ValueError(f"{model_dir}: a {tok['model']['type']} tokenizer; only byte-level BPE is written")
    special = {t["id"]: t["content"] for t in tok.get("added_tokens", [])}
    by_id = {i: s for s, i in tok["model"]["vocab"].items()} | special
    tokens, types = [], []
    for i in range(vocab_size):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        types.append(gguf.TokenType.CONTROL if i in special else
                     gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        if isinstance(config.get(key), int):
            add(config[key])
    writer.add_add_bos_token(False)


def write_gguf(model_dir: Path, gtype: str, out: Path) -> None:
    import gguf
    import numpy as np

    config = json.loads((model_dir / "config.json").read_text())
    arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}.get(config["architectures"][0])
    if arch is None:
        raise ValueError(f"{config['architectures'][0]}: only llama and qwen2 models are written as GGUF here")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "bf16": gguf.GGMLQuantizationType.BF16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[gtype]
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[gtype]
    tensors = read_safetensors(model_dir)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(model_dir.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(file_type)
    add_tokenizer(writer, model_dir, config["vocab_size"], config)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    for hf, w in tensors.items():
        name = gguf_name(hf)
        if name is None:
            raise ValueError(f"{hf}: no GGUF name for this tensor")
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            w = permute_rows(w, heads if "q_proj" in hf else kv_heads)
        if w.ndim == 2 and gtype != "f32":
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(w), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- serving (.venv-llamacpp) -----------------------------------------------------------------------
def _status_kib(field: str) -> int:
    return int(Path("/proc/self/status").read_text().split(f"{field}:", 1)[1].split()[0])


def tensor_bytes(path: Path) -> tuple[int, int]:
    """(all tensors' bytes, the token embedding's bytes) of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    return sum(sizes.values()), sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0


class Peer:
    def __init__(self, args):
        import llama_cpp

        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass
        start = time.perf_counter()
        self.llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=512, n_batch=512, n_threads=args.threads,
                                   n_threads_batch=args.threads, use_mmap=False, logits_all=True, seed=0,
                                   verbose=False)
        self.load_s = time.perf_counter() - start

    def logits(self, ids: list[int]):
        self.llm.reset()
        self.llm.eval(ids)
        return self.llm.scores[:len(ids)]

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(prompt)
        out = []
        for _ in range(n):
            out.append(int(self.llm.scores[self.llm.n_tokens - 1].argmax()))
            if len(out) < n:
                self.llm.eval([out[-1]])
        return out

    def quality(self, ref_path: str) -> dict:
        import numpy as np

        ref = np.load(ref_path)
        diffs, agree, total = [], 0, 0
        for prompt, ref_logits, tokens in zip(ref["prompts"].tolist(), ref["logits"], ref["tokens"].tolist()):
            diffs.append(np.abs(self.logits(prompt) - ref_logits))
            picked = self.logits(prompt + tokens[:-1])[len(prompt) - 1:].argmax(axis=-1)
            agree += int((picked == np.array(tokens)).sum())
            total += len(tokens)
        d = np.stack(diffs)
        return {"logit_error": {"max": float(d.max()), "mean": float(d.mean()),
                                "ref_mean_abs": float(np.abs(ref["logits"]).mean())},
                "agreement": {"agree": agree, "total": total, "fraction": agree / total}}


def serve(args) -> None:
    out = os.fdopen(args.reply_fd, "w", buffering=1)

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")

    try:
        peer = Peer(args)
        figures = {"load_s": peer.load_s, "peak_rss_mib": _status_kib("VmHWM") / 1024,
                   "rss_mib": _status_kib("VmRSS") / 1024}
        weights, unread = tensor_bytes(Path(args.gguf))
        figures.update(weights_bytes=weights, read_bytes=weights - unread, kv_pool_bytes=0)
        if args.ref and Path(args.ref).exists():
            figures.update(peer.quality(args.ref))
    except Exception as e:  # the driver reports it beside the other runs
        reply({"error": f"{type(e).__name__}: {e}"})
        raise
    reply(figures)
    prompt = [7 + i % 100 for i in range(BATCH1_PROMPT)]
    for line in sys.stdin:
        cmd = json.loads(line)["cmd"]
        if cmd == "batch1":
            t = time.perf_counter()
            peer.greedy(prompt, 1)
            one = time.perf_counter() - t
            t = time.perf_counter()
            returned = len(peer.greedy(prompt, 1 + args.decode_tokens))
            reply({"one_s": one, "many_s": time.perf_counter() - t, "returned_tokens": returned})
        elif cmd == "quit":
            return
        else:
            reply({"error": f"unknown command {cmd!r} (llama.cpp's side answers batch1 and quit)"})


def drive(args) -> None:
    """From our venv: each type's GGUF written when missing, loaded and timed `--repeats` times."""
    import tempfile

    from runner_core.loader.model_loader import resolve_model_path

    if not available():
        raise SystemExit(f"benchmarks/llamacpp_peer.py needs llama.cpp's venv, {PYTHON.parent.parent}: "
                         "make bench-llamacpp-peer builds it (about 30 minutes on 2 cores)")
    model_dir = str(resolve_model_path(args.model))
    args.timeout = 1800
    with tempfile.TemporaryDirectory(prefix="llamacpp-peer-") as tmp:
        for gtype in args.types:
            proc = start(model_dir, gtype, Path(tmp), args)
            try:
                proc.ask("batch1")
                rates = []
                for _ in range(args.repeats):
                    res = proc.ask("batch1")
                    rates.append(args.decode_tokens / (res["many_s"] - res["one_s"]))
            finally:
                proc.close()
            rates.sort()
            print(f"{args.model} llama.cpp {gtype}: batch-1 {rates[len(rates) // 2]:.1f} tok/s "
                  f"[{rates[0]:.1f}-{rates[-1]:.1f}], RSS after load {proc.started['rss_mib']:.0f} MiB, "
                  f"peak {proc.started['peak_rss_mib']:.0f}, tensors {proc.started['weights_bytes'] / 2**20:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write one GGUF file (in .venv-llamacpp)")
    mode.add_argument("--serve", action="store_true", help="serve one GGUF file (in .venv-llamacpp)")
    ap.add_argument("--model", default="small-llama", help="a preset or model directory (driving from our venv)")
    ap.add_argument("--types", nargs="+", choices=ALL_TYPES, default=list(TYPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--type", choices=ALL_TYPES)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--gguf")
    ap.add_argument("--ref")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--reply-fd", type=int)
    args = ap.parse_args()
    if args.write:
        tmp = args.out.with_suffix(".partial")
        write_gguf(args.model_dir, args.type, tmp)
        tmp.rename(args.out)
    elif args.serve:
        serve(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
