"""Where a one-token step's time goes: torch.profiler over 5 full-depth one-token forwards plus
the head, SmolLM2 at context 100, the lean step (eager) or the general path.

    .venv/bin/python scripts/profile_step.py [--dtype bfloat16] [--general]
"""

import argparse

import torch
from torch.profiler import profile

import selfspec
from selfspec.api import SelfSpecModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--general", action="store_true", help="the adapter's general path instead of the lean step")
    args = ap.parse_args()
    base = selfspec.load(dtype=args.dtype, progress=False, exact=False)
    model = SelfSpecModel(base.hf_model, base.tokenizer, base.name, lean=not args.general) if args.general else base
    a = model.adapter
    cache = a.new_cache(300)
    with torch.inference_mode():
        a.run_layers(a.embed(torch.arange(100, 200)), range(a.n_layers), 0, cache)
        token = torch.tensor([5])

        def step():
            return a.head(a.run_layers(a.embed(token), range(a.n_layers), 100, cache))

        for _ in range(3):
            step()
        with profile() as prof:
            for _ in range(5):
                step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
