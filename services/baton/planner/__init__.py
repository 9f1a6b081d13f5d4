"""Capacity planning: how many prefill and decode pods meet a TTFT/ITL target, and keeping
the Deployments at that size.

    profile.py         Profile: fitted step-cost models + raw points, YAML load/save, the fit
    measure.py         `baton profile`: times real engine steps (prefill sizes, decode grid)
    simulate.py        discrete-event simulation of p prefill + d decode pods on a trace
    speculation.py     speculative decoding as rows and tokens per decode step, learnt from
                       the pods' spec_decode counters
    plan.py            `baton plan`: the fewest p + d meeting the SLO, table / JSON output
    base.py            interfaces: MetricsSource (live workload), KubeClient (replicas)
    metrics_source.py  ScrapeSource: rates, mean lengths and speculation from Prometheus
                       pages (every router pod behind a name, each against its own baseline)
    kube.py            KubernetesClient: the Deployment scale subresource (official client)
    scaler.py          `baton planner`: the loop (plan, clamp, hysteresis, dry run)
    cli.py             the three subcommands, added to `baton` by `add_subcommands`

Nothing here imports torch except `measure.py` (through the engine), so the planner's pod
needs no model and no accelerator.
"""
