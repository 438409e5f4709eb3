"""What tensor parallelism's communication adds to the cost model's T(s), and to the paper's case study.

An HDP rank of TP t is t GPUs of one node; per layer it all-reduces its tokens' hidden states 4 times
(Megatron TP: 2 forward, 2 backward), each a ring over the t devices' own intra-node links
(`CostModel.tp_time_per_token`). Prints:
  1. per model (LLaMA-7B, LLaMA-70B) and cluster preset (H100 NVLink, the paper's L20 PCIe servers), at
     TP 1/2/4/8: one layer's fwd+bwd time T(s) of a rank holding 32K tokens, without and with the TP
     all-reduces, and their share of it ("-" where the TP group does not fit one switch);
  2. the case study (LLaMA-7B, 512 HDP ranks x TP 2 on the L20 preset, Byted-like, 2M context, C = 8K, 32M
     tokens): simulated step time of balance and static, without and with the TP term.
Runs in well under a minute on the project's 2-core machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bytescale_compile.planner import CostModel, Hardware  # noqa: E402
from bytescale_compile.sim.experiments import run_strategy  # noqa: E402
from bytescale_compile.sim.lengths import sample_global_batch  # noqa: E402

K, M = 2**10, 2**20
MODELS = ("llama-7b", "llama-70b")
CLUSTERS = ("h100-nvlink", "l20")
TP_SIZES = (1, 2, 4, 8)
RANK_TOKENS = 32 * K
CASE_RANKS, CASE_TP, CASE_CONTEXT, CASE_CAPACITY, CASE_TOKENS = 512, 2, 2 * M, 8 * K, 32 * M
CASE_STRATEGIES = ("balance", "static")


def without_tp(cost: CostModel) -> CostModel:
    """The same rank with its TP all-reduces left uncharged (the cost model before TP was modelled)."""
    return cost.replace(tp_comm_time=0.0)


def rank_cost(model: str, cluster: str, tp: int) -> CostModel | None:
    """The analytic cost model of one HDP rank of `tp` GPUs; None where the TP group does not fit a switch."""
    try:
        return CostModel.preset(model, Hardware.preset(cluster, tp_size=tp))
    except ValueError:
        return None


def layer_table() -> None:
    print(f"1. one layer's fwd+bwd T(s) of an HDP rank holding {RANK_TOKENS // K}K tokens (ms)")
    print(f"  {'model':>10} {'cluster':>12} {'tp':>3} {'no TP comm':>11} {'with TP comm':>13} {'TP share':>9}")
    for model in MODELS:
        for cluster in CLUSTERS:
            for tp in TP_SIZES:
                cost = rank_cost(model, cluster, tp)
                if cost is None:
                    print(f"  {model:>10} {cluster:>12} {tp:>3} {'-':>11} {'-':>13} {'-':>9}   (TP group > switch)")
                    continue
                bare = float(without_tp(cost).layer_time(RANK_TOKENS))
                charged = float(cost.layer_time(RANK_TOKENS))
                share = (charged - bare) / charged
                print(f"  {model:>10} {cluster:>12} {tp:>3} {bare * 1e3:>11.3f} {charged * 1e3:>13.3f} {share:>8.1%}")


def case_study(seed: int = 0) -> None:
    print(
        f"\n2. case study: llama-7b, {CASE_RANKS} HDP ranks x TP {CASE_TP} on l20, Byted-like, "
        f"{CASE_CONTEXT // M}M context, C = {CASE_CAPACITY // K}K, {CASE_TOKENS // M}M tokens (seed {seed})"
    )
    cost = CostModel.preset("llama-7b", Hardware.preset("l20", tp_size=CASE_TP))
    lens = sample_global_batch("byted", CASE_TOKENS, seed=seed, max_len=CASE_CONTEXT)
    print(f"  {'strategy':>9} {'no TP comm s':>13} {'with TP comm s':>15} {'added':>7}")
    for strategy in CASE_STRATEGIES:
        bare, charged = (
            run_strategy(strategy, lens, CASE_RANKS, CASE_CAPACITY, c, CASE_CONTEXT).step_time
            for c in (without_tp(cost), cost)
        )
        print(f"  {strategy:>9} {bare:>13.2f} {charged:>15.2f} {charged / bare - 1:>6.1%}")


def main() -> None:
    layer_table()
    case_study()


if __name__ == "__main__":
    main()
