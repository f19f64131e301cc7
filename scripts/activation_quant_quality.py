"""Why the integer int8 products take x as int16 (kernels/product.h, rows_vnni): SmolLM2 in float32
against int8 weights (one scale per output row, as --dtype int8) with x, the input of every
decoder-layer projection, kept in float, or rounded to int8 (one scale per row, or per block of 64
or 32) or to 15-bit int16 (one scale per row, what the kernel does). Simulated in PyTorch (rounding
x, then float products), on 10 Spec-Bench first turns, 64 greedy tokens each: the share of
float32's own greedy tokens that stay top-1 when fed float32's text (teacher-forced), the mean NLL
of that text, and the position of the first greedy token that differs from float32.

    .venv/bin/python scripts/activation_quant_quality.py
"""

import json
from pathlib import Path

import torch

import selfspec

BENCH = Path(__file__).resolve().parents[2] / "shared" / "bench" / "spec_bench_questions.jsonl"


def rounded(x: torch.Tensor, levels: int, block: int | None) -> torch.Tensor:
    """x with each row (or each block of a row) rounded to integers in ±levels at scale max|x| / levels."""
    shape, k = x.shape, x.shape[-1]
    b = k if block is None else block
    xb = x.reshape(-1, k // b, b)
    s = xb.abs().amax(-1, keepdim=True).clamp(min=1e-30) / levels
    return (torch.round(xb / s).clamp(-levels, levels) * s).reshape(shape)


def main() -> None:
    torch.set_num_threads(2)
    model = selfspec.load(None, dtype="float32", progress=False, lean=False)
    hf, tok = model.hf_model, model.tokenizer
    questions = [json.loads(line) for line in BENCH.read_text().splitlines() if line.strip()]
    prompts = [q["turns"][0] for q in questions[::8][:10]]
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
           for p in prompts]
    ids = [i if isinstance(i, torch.Tensor) else i["input_ids"] for i in ids]
    linears = [m for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    original = [m.weight.data.clone() for m in linears]
    mode: dict = {"x": None}
    for m in linears:
        m.register_forward_pre_hook(lambda _, args: None if mode["x"] is None else (rounded(args[0], *mode["x"]),))

    def generate(i):
        with torch.no_grad():
            return hf.generate(i, max_new_tokens=64, do_sample=False, attention_mask=torch.ones_like(i))[0, i.shape[1]:]

    reference = [generate(i) for i in ids]

    def evaluate(name):
        agree = total = 0
        nll = 0.0
        first = []
        for i, ref in zip(ids, reference):
            out = generate(i)
            n = min(len(ref), len(out))
            first.append(next((t for t in range(n) if ref[t] != out[t]), n))
            with torch.no_grad():
                logits = hf(torch.cat([i[0], ref])[None]).logits[0, i.shape[1] - 1:-1]
            agree += (logits.argmax(-1) == ref).sum().item()
            total += len(ref)
            nll += torch.nn.functional.cross_entropy(logits, ref, reduction="sum").item()
        print(f"{name:34s} top-1 kept {agree / total:.3f}  NLL/token {nll / total:.3f}  first difference at {first}",
              flush=True)

    evaluate("float32")
    for m, w in zip(linears, original):  # int8 weights, one bfloat16 scale per output row (quantize.py)
        s = (w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127).bfloat16().float()
        m.weight.data = torch.round(w / s).clamp(-127, 127) * s
    evaluate("int8 weights, x float")
    for name, x in [("int8 weights, x int8 per row", (127, None)), ("int8 weights, x int8 blocks of 64", (127, 64)),
                    ("int8 weights, x int8 blocks of 32", (127, 32)), ("int8 weights, x int16 per row", (16383, None))]:
        mode["x"] = x
        evaluate(name)


if __name__ == "__main__":
    main()
