"""The README's first command as a new user's process runs it, timed from the stream() call to
the last token (everything after the model load: the drafter's setup, the prefill, decoding),
beside the tok/s the stats report (prefill + rounds), and the setup before the prefill (the first
token's time less the prefill's: the drafter's setup, its `begin`, the cache). Threads are chosen
as the CLI chooses them (the cores no other process keeps busy).

    for i in 1 2 3 4 5 6 7; do for m in auto ar; do .venv/bin/python scripts/first_generate.py $m; done; done
"""

import sys
import time
import warnings

import selfspec
from selfspec.model.threads import apply_threads

warnings.simplefilter("ignore")
threads = apply_threads(None)
model = selfspec.load("smollm2", progress=False)
method = sys.argv[1] if len(sys.argv) > 1 else "auto"
t = time.perf_counter()
first = None
stream = model.stream("Why is the sky blue?", method=method, max_new_tokens=128)
for _ in stream:
    if first is None:
        first = time.perf_counter() - t
seconds = time.perf_counter() - t
stats = stream.result.stats
print(f"{method:5s} {threads or 'default threads'}: setup {(first - stats.prefill_s) * 1e3:5.1f} ms, "
      f"first token {first * 1e3:6.1f} ms, generate {seconds:.3f} s, prefill {stats.prefill_s * 1e3:.0f} ms, "
      f"{stats.new_tokens} tokens: {stats.new_tokens / seconds:.1f} tok/s (stats report {stats.tokens_per_s:.1f}; "
      f"α {stats.alpha if stats.alpha is None else round(stats.alpha, 2)}, "
      f"c {stats.cost if stats.cost is None else round(stats.cost, 2)})", flush=True)
