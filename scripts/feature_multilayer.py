"""Would EAGLE-3's fused features lift the feature head's α? An experiment on kept calibration data.

The shipped head drafts from h_L, the last layer's state of the previous position. EAGLE-3 (Li et
al. 2025) feeds a low, a middle and a high layer's states instead, projected to one vector. This
re-reads the data that `selfspec calibrate --head feature --data FILE` kept (the same sequences,
the same held-out split by prompt), teacher-forces each sequence once more to take the states
after the given layers besides h_L, and trains the same head with those inputs
(`train_feature_head(parts=...)`), printing held-out α by draft position next to the plain head
trained in the same way on the same data.

    .venv/bin/python scripts/feature_multilayer.py /tmp/fdata.pt --layers 3 15 [--steps 2000] [--threads 2]

Training only: the drafter cannot run such a head yet (the verify would have to keep those layers'
states too), so nothing is saved.
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

import selfspec
from selfspec.feature_calibrate import FeatureSequence, table, train_feature_head


@torch.inference_mode()
def with_layers(adapter, x: FeatureSequence, layers: list[int]) -> torch.Tensor:
    """[T, (len(layers) + 1)·d]: the states after each of `layers` and h_L, in the model's dtype."""
    cache = adapter.new_cache(x.ids.numel())
    h = adapter.embed(x.ids.to(adapter.device))
    states, done = [], 0
    for k in [*layers, adapter.n_layers]:
        h = adapter.run_layers(h, range(done, k), 0, cache)
        states.append(h.reshape(x.ids.numel(), -1).cpu())
        done = k
    return torch.cat(states, dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="a --data file of `selfspec calibrate --head feature`")
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 15], help="layers whose states join h_L")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-text", action="store_true", help="leave out --text windows")
    parser.add_argument("--plain", action="store_true", help="also train the plain head (h_L only) here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kept = torch.load(args.data, weights_only=True)
    data = [FeatureSequence(**x) for x in kept["data"]]
    if args.no_text:
        data = [x for x in data if not x.text]
    model = selfspec.load(args.model, dtype=args.dtype, progress=False)
    adapter = model.adapter
    if not all(0 < k < adapter.n_layers for k in args.layers):
        raise SystemExit(f"--layers must be in 1..{adapter.n_layers - 1}")
    print(f"{model.name}, {args.dtype}; {len(data)} sequences from {args.data} ({kept['key']})")
    if args.plain:
        t = time.perf_counter()
        plain = train_feature_head(adapter, data, steps=args.steps, progress=True)
        print(f"\nh_L only: {plain.train_positions} training positions, {plain.held_out_positions} held out; "
              f"{time.perf_counter() - t:.0f} s\n{table(plain)}")
    t = time.perf_counter()
    differ = 0
    for x in tqdm(data, desc="teacher-force with layers", unit="sequence"):
        states = with_layers(adapter, x, args.layers)
        differ += int(not torch.equal(states[:, -x.final.shape[1]:], x.final))
        x.final = states
    print(f"\nstates after layers {args.layers} and {adapter.n_layers}: {time.perf_counter() - t:.0f} s; "
          f"h_L differs from the kept one in {differ} of {len(data)} sequences")
    t = time.perf_counter()
    fused = train_feature_head(adapter, data, steps=args.steps, parts=len(args.layers) + 1, progress=True)
    print(f"\nh after layers {args.layers} and h_L, fused: {fused.head.n_params / 1e6:.2f}M parameters; "
          f"{time.perf_counter() - t:.0f} s\n{table(fused)}")


if __name__ == "__main__":
    main()
