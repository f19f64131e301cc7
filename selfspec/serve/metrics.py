"""What a server's /metrics reports, in Prometheus' text format.

A server's state is first read into a plain, picklable `snapshot` (numbers only), so that replicas
in other processes (selfspec.serve.replicas) can send theirs to one place. `render` turns snapshots into
the exposition: one process's figures unlabelled; several replicas' each labelled `replica`, plus
an unlabelled sample for all of them together, so one query reads the whole server either way.

Drafting figures (drafted and accepted tokens, rounds, α, tokens per round, draft length) are also
given per method (label `method`, the request's), and in `selfspec_source_*` per method and source
(label `source`: the drafter that drafted each round, e.g. a suffix request's "suffix" match or
"feature" head token; "ar" for rounds with no draft), from each request's GenerationStats.by_source.
"""

from __future__ import annotations

import dataclasses
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from selfspec.core.stats import add_counts


def _rates(c: dict) -> dict:
    """Ratios of one set of drafting counts ({"rounds", "drafted", "accepted", "draft_rounds"})."""
    return {"alpha": c["accepted"] / c["drafted"] if c["drafted"] else 0.0,
            "per_round": (c["accepted"] + c["rounds"]) / c["rounds"] if c["rounds"] else 0.0,
            "draft_len": c["drafted"] / c["draft_rounds"] if c["draft_rounds"] else 0.0}


def _source_counts(source: str, c: dict) -> dict:
    return {**c, "draft_rounds": 0 if source == "ar" else c["rounds"]}


def by_method(s: dict) -> dict[str, dict]:
    """Each method's drafting counts, its sources summed; draft_rounds: its rounds that drafted."""
    out = {}
    for method, sources in s.get("by_method", {}).items():
        total = {"rounds": 0, "drafted": 0, "accepted": 0, "draft_rounds": 0}
        for source, c in sources.items():
            total = add_counts(total, _source_counts(source, c))
        out[method] = total
    return out


def _draft_rounds(s: dict) -> int:
    return sum(c["draft_rounds"] for c in by_method(s).values())


def _age(s: dict) -> float:
    """The oldest active row's age now, from a snapshot taken at time `at` (maybe elsewhere)."""
    return s["oldest_active_s"] + time.time() - s["at"] if s["active_rows"] else 0.0


# (name, doc, value of one snapshot). Ratios are computed from summed counters, so the total is the
# ratio over all replicas' requests, not a mean of ratios.
COUNTERS = [
    ("requests", "Requests finished (including failed, cancelled and timed out)", lambda s: s["requests"]),
    ("requests_failed", "Requests that ended with an error", lambda s: s["failed"]),
    ("requests_cancelled", "Requests cancelled (client gone, stop string or server shutdown)", lambda s: s["cancelled"]),
    ("requests_timed_out", "Requests ended by the server's --max-request-seconds", lambda s: s["timed_out"]),
    ("prompt_tokens", "Prompt tokens (prefilled, or read from a prefix store)", lambda s: s["prompt_tokens"]),
    ("prefix_reused_tokens", "Prompt tokens whose keys and values came from a prefix store, not a prefill",
     lambda s: s.get("prefix_tokens", 0)),
    ("generated_tokens", "Tokens generated", lambda s: s["new_tokens"]),
    ("draft_tokens", "Draft tokens proposed", lambda s: s["drafted"]),
    ("accepted_tokens", "Draft tokens accepted", lambda s: s["accepted"]),
    ("verify_rounds", "Verify rounds over all requests", lambda s: s["rounds"]),
    ("batch_drafts_dropped", "Drafts a batch verified as plain steps, where dropping them was expected to commit "
     "more tokens per second", lambda s: s.get("drafts_dropped", 0)),
    ("batch_drafts_cut", "Drafts a batch verified in part (their likeliest tokens), where the rest were expected "
     "to cost more than they commit", lambda s: s.get("drafts_cut", 0)),
    ("batch_drafting_skipped", "Rows a batch stepped plain without drafting, where drafts of their recent lengths "
     "were expected to be dropped", lambda s: s.get("drafting_skipped", 0)),
    ("draft_seconds", "Time spent drafting", lambda s: s["draft_s"]),
    ("verify_seconds", "Time spent in verify forwards (once per batched forward)", lambda s: s["verify_s"]),
    ("prefill_seconds", "Time spent prefilling prompts", lambda s: s["prefill_s"]),
]
GAUGES = [
    ("acceptance_rate", "α over all finished requests: accepted / drafted",
     lambda s: s["accepted"] / s["drafted"] if s["drafted"] else 0.0),
    ("mean_accepted_length", "Tokens committed per verify round, bonus included",
     lambda s: (s["accepted"] + s["rounds"]) / s["rounds"] if s["rounds"] else 0.0),
    ("mean_draft_length", "Draft tokens per round that drafted (γ as used, after each drafter's own limits)",
     lambda s: s["drafted"] / _draft_rounds(s) if _draft_rounds(s) else 0.0),
    ("batch_rows_mean", "Mean rows per batched verify forward", lambda s: s["rows"] / s["steps"] if s["steps"] else 0.0),
    ("queue_depth", "Requests waiting for a row", lambda s: s["queue_depth"]),
    ("active_rows", "Requests being decoded", lambda s: s["active_rows"]),
    ("oldest_active_seconds", "Age of the oldest request being decoded (0 when none)", _age),
    ("suffix_store_tokens", "Tokens of past requests the suffix store holds, all tenants (method suffix)",
     lambda s: s.get("suffix_tokens", 0)),
    ("suffix_store_sequences", "Prompts and answers the suffix store holds, all tenants", lambda s: s.get("suffix_sequences", 0)),
    ("prefix_store_bytes", "Bytes of keys and values the prefix stores hold", lambda s: s.get("prefix_bytes", 0)),
    ("prefix_store_entries", "Earlier requests whose keys and values the prefix stores hold",
     lambda s: s.get("prefix_entries", 0)),
]

# The families above also given per method and per source: name -> value of one set of counts.
DRAFTING = {
    "draft_tokens": lambda c: c["drafted"],
    "accepted_tokens": lambda c: c["accepted"],
    "verify_rounds": lambda c: c["rounds"],
    "acceptance_rate": lambda c: _rates(c)["alpha"],
    "mean_accepted_length": lambda c: _rates(c)["per_round"],
    "mean_draft_length": lambda c: _rates(c)["draft_len"],
}


def snapshot(server) -> dict:
    """The figures /metrics reports for one server (selfspec.serve.server.Server), as plain numbers."""
    scheduler = server.scheduler
    return {**dataclasses.asdict(scheduler.totals), "rejected": dict(server.rejected),
            "queue_depth": scheduler.queue_depth, "active_rows": len(scheduler.active),
            "oldest_active_s": scheduler.oldest_active_s(), "at": time.time(),
            "suffix_tokens": sum(store.tokens for store in server.model.suffix_stores()),
            "suffix_sequences": sum(store.sequences for store in server.model.suffix_stores()),
            "prefix_bytes": sum(store.nbytes for store in server.model.prefix_stores()),
            "prefix_entries": sum(len(store) for store in server.model.prefix_stores())}


def combine(snapshots: list[dict]) -> dict:
    """Several replicas as one: counts add up; the oldest row is the oldest of any replica."""
    now = time.time()
    total = {"at": now, "rejected": {}}
    for s in snapshots:
        for key, value in s.items():
            if isinstance(value, dict):  # rejected by reason, by_method
                total[key] = add_counts(total.get(key, {}), value)
            elif key not in ("at", "oldest_active_s"):
                total[key] = total.get(key, 0) + value
    total["oldest_active_s"] = max((_age(s) for s in snapshots), default=0.0)
    return total


def render(snapshots: dict[str | None, dict]) -> bytes:
    """The exposition of one server ({None: snapshot}) or of replicas ({replica id: snapshot})."""
    registry = CollectorRegistry()
    registry.register(_Collector(snapshots))
    return generate_latest(registry)


class _Collector:
    def __init__(self, snapshots: dict[str | None, dict]):
        # (replica id or None for the whole server, its snapshot)
        self.samples = list(snapshots.items())
        if list(snapshots) != [None]:
            self.samples = sorted(self.samples, key=lambda x: x[0]) + [(None, combine(list(snapshots.values())))]

    def collect(self):
        for kind, suffix, table in ((CounterMetricFamily, "_total", COUNTERS), (GaugeMetricFamily, "", GAUGES)):
            for name, doc, value in table:
                family = kind(f"selfspec_{name}", doc)
                for replica, s in self.samples:
                    family.add_sample(family.name + suffix, _labels(replica), value(s))
                if name in DRAFTING:
                    for replica, s in self.samples:
                        for method, counts in sorted(by_method(s).items()):
                            family.add_sample(family.name + suffix, {"method": method, **_labels(replica)},
                                              DRAFTING[name](counts))
                yield family
        for kind, suffix, table in ((CounterMetricFamily, "_total", COUNTERS), (GaugeMetricFamily, "", GAUGES)):
            for name, doc, _ in table:
                if name not in DRAFTING:
                    continue
                family = kind(f"selfspec_source_{name}", f"{doc}, by method and the source that drafted each round")
                for replica, s in self.samples:
                    for method, sources in sorted(s.get("by_method", {}).items()):
                        for source, counts in sorted(sources.items()):
                            family.add_sample(family.name + suffix, {"method": method, "source": source, **_labels(replica)},
                                              DRAFTING[name](_source_counts(source, counts)))
                yield family
        rejected = CounterMetricFamily("selfspec_requests_rejected", "Requests refused before decoding")
        for replica, s in self.samples:
            for reason, count in s["rejected"].items():
                rejected.add_sample(rejected.name + "_total", {"reason": reason, **_labels(replica)}, count)
        yield rejected


def _labels(replica: str | None) -> dict:
    return {} if replica is None else {"replica": replica}
