"""``pdserve plan``: KV sizes, a hardware cost model and a simulator that drives the real conductor.

- :mod:`.kvsize`     KV bytes from an HF config.json or a preset (GQA, MLA, sliding + full, MoE)
- :mod:`.hardware`   accelerator and link catalogue (data/hardware.yaml); :mod:`.measure` this machine
- :mod:`.cost`       hardware-derived CostModel (the conductor's protocol); :mod:`.calibrate` a fitted one
- :mod:`.traffic`    Mooncake traces and Poisson traffic
- :mod:`.worker`     a simulated vLLM engine; :mod:`.simulator` the event loop around the Conductor
- :mod:`.results`, :mod:`.search`, :mod:`.cli`  figures, candidates and the recommendation
"""
