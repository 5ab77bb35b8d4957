"""braid's flow-level simulator: braid's plans, run on modelled machines.

    flow.py         links, flows, max-min fair sharing, chunk-pipeline formulas
    topology.py     presets (presets/*.json, every constant with its source), N x 8 GPU clusters,
                    the router's Topology built from a preset
    collectives.py  an op split by the planner's shares -> flows per lane -> time
    traffic.py      traffic matrices through the router; one GPU's stream over borrowed NICs
    repro.py        FlexLink, FuseLink and NIMBLE's figures beside the simulated ones
    own.py          the simulator against braid's recorded bench on our 2- and 4-GPU H200 host
    scale.py        all_reduce, all_gather, skewed all-to-all-v on 2..128 nodes x 8 GPUs
    cli.py          `braid sim reproduce NAME`, `braid sim scale`

Pure Python + numpy; never imports torch (the CLI and the tests run it on any CPU).
"""
