"""``kvstore bench decisions``' figures: each case's row against the better pure policy, the
partial-plan and prediction rows, and the plot."""

from __future__ import annotations

from benchmarks.common import Result, plot_title

POLICIES = ("restore", "recompute", "auto")
TARGET = 1.05  # the plan over the better pure policy, at most
SPLIT_WAIT_S = 10.0  # a split case waits this long at most for the prefix to leave dram


def throttle_label(throttle: int) -> str:
    return f"{throttle / 1e6:.0f} MB/s" if throttle else "unthrottled"


def _where(case: dict[str, object]) -> str:
    if case["tier"] == "mixed":
        return f"head in dram, tail in nvme at {throttle_label(int(str(case['throttle'])))}"
    return f"{case['tier']}, {throttle_label(int(str(case['throttle'])))}"


def partial_rows(curves: list[dict[str, object]]) -> list[Result]:
    """How often the plan restored part of a mixed prefix, and how it did where part was best."""
    mixed = [c for c in curves if c["tier"] == "mixed" and valid_case(c)]
    if not mixed:
        return []
    partial = [c for c in mixed if 0 < _loaded(c, "auto") < _loaded(c, "restore")]
    rows = [
        Result(
            "plan restored part of a split prefix",
            len(partial),
            "cases",
            "split-prefix cases with their split in place",
            len(mixed),
            None,
            "head in dram, tail in nvme at 0.5x / 1x / 2x of the tail's crossover bandwidth",
        )
    ]
    for c in mixed:
        if float(str(c["crossover_factor"])) < 1.0:  # below the crossover: partial is the one to beat with
            rows.append(
                Result(
                    f"partial plan vs better pure, {c['length']}-token split prefix, "
                    f"tail at {c['crossover_factor']}x crossover",
                    float(str(c["ratio"])),
                    "x",
                    f"{c['better']}, same round",
                    1.0,
                    "<= 0.9",
                    f"plan loaded {_loaded(c, 'auto'):.0f} of {_loaded(c, 'restore'):.0f} tokens",
                )
            )
    return rows


def _loaded(case: dict[str, object], policy: str) -> float:
    loaded = case["loaded"]
    assert isinstance(loaded, dict)
    return float(loaded[policy])


def progress_line(result: Result) -> str:
    ratio = result.ratio
    return f"{result.metric}: " + (f"{ratio:.2f}x" if ratio is not None else "not a comparison")


def valid_case(case: dict[str, object]) -> bool:
    """A split case compares the policies only if every restore-capable run started from it."""
    return not case.get("wrong_splits")


def case_result(case: dict[str, object]) -> Result:
    med = {p: float(str(case[p])) for p in POLICIES}
    loaded = case["loaded"]
    assert isinstance(loaded, dict)
    if not valid_case(case):
        return Result(
            f"plan, {case['length']}-token prefix, {_where(case)}",
            None,
            "x",
            note=f"not a comparison: {case['wrong_splits']} restore-capable runs did not start from the "
            f"head/tail split (the prefix did not leave dram within {SPLIT_WAIT_S:.0f} s)",
        )
    return Result(
        f"plan, {case['length']}-token prefix, {_where(case)}",
        float(str(case["ratio"])),
        "x",
        f"{case['better']}, same round",
        1.0,
        f"<= {TARGET}",
        f"medians: plan {med['auto'] * 1e3:.0f} ms, restore {med['restore'] * 1e3:.0f} ms, recompute "
        f"{med['recompute'] * 1e3:.0f} ms; plan loaded {loaded['auto']:.0f} of {loaded['restore']:.0f} tokens",
    )


def agrees(case: dict[str, object]) -> bool:
    """The plan took the faster policy's action, or the two were too close to tell apart."""
    restore, recompute = float(str(case["restore"])), float(str(case["recompute"]))
    loaded = case["loaded"]
    assert isinstance(loaded, dict)
    if max(restore, recompute) <= TARGET * min(restore, recompute):
        return True
    want = loaded["restore"] if restore < recompute else 0
    return bool(loaded["auto"] == want)


def prediction_rows(curves: list[dict[str, object]]) -> list[Result]:
    """Measured over predicted time to first token of the engine's timed requests (its own
    ``kvstore_connector_ttft_actual_over_predicted`` series, summed over the cases), by decision."""
    totals: dict[str, float] = {}
    for case in curves:
        deltas = case["auto_metrics"]
        assert isinstance(deltas, dict)
        for name, value in deltas.items():
            totals[name] = totals.get(name, 0.0) + value
    rows = []
    for decision in ("restore", "partial", "recompute"):
        count = totals.get(f"kvstore_connector_ttft_actual_over_predicted_count{{decision={decision}}}", 0)
        if count:
            total = totals[f"kvstore_connector_ttft_actual_over_predicted_sum{{decision={decision}}}"]
            rows.append(
                Result(
                    f"cost model, {decision}: measured / predicted ttft",
                    total / count,
                    "x",
                    note=f"mean over the {count:.0f} timed requests that did {decision} (plan or forced)",
                )
            )
    return rows


def plot_cases(
    curves: list[dict[str, object]], path: str, model: str, machine: dict[str, object] | None = None
) -> None:
    """One panel per source tier and throttle, the same axes in all (log time); the plan's line
    drawn last, thick and black, over the two pure strategies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def panel(c: dict[str, object]) -> tuple[str, float]:
        # mixed cases throttle by length (the tail's crossover): one panel per crossover factor
        if c["tier"] == "mixed":
            return "mixed", float(str(c["crossover_factor"]))
        return str(c["tier"]), float(str(c["throttle"]))

    panels = sorted({panel(c) for c in curves}, key=lambda p: (p[0], p[1] != 0, -p[1]))
    columns = len({value for tier, value in panels if tier != "mixed"}) or 3
    rows_n = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(
        rows_n, columns, figsize=(4 * columns, 3.3 * rows_n + 0.6), squeeze=False, sharex=True, sharey=True
    )
    for ax, key in zip(axes.flat, panels, strict=False):
        rows = sorted((c for c in curves if panel(c) == key), key=lambda c: int(str(c["length"])))
        xs = [int(str(c["length"])) for c in rows]
        for policy, style in (
            ("restore", {"linestyle": "--", "color": "tab:blue", "marker": "s"}),
            ("recompute", {"linestyle": ":", "color": "tab:orange", "marker": "^"}),
            ("auto", {"linestyle": "-", "color": "black", "marker": "o", "linewidth": 2.5, "zorder": 3}),
        ):
            label = "plan" if policy == "auto" else f"all-{policy}"
            ax.plot(xs, [float(str(c[policy])) * 1e3 for c in rows], label=label, **style)  # type: ignore[arg-type]
        tier, value = key
        ax.set_title(
            f"dram head, nvme tail at {value}x crossover"
            if tier == "mixed"
            else f"from {tier}, {throttle_label(int(value))}"
        )
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("prefix tokens")
    for ax in axes[:, 0]:
        ax.set_ylabel("time to first token (ms)")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(
        plot_title(
            "the plan against all-restore and all-recompute (vLLM CPU)",
            model,
            "bandwidth emulated: each tier throttled as its panel says",
            machine,
        ),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
