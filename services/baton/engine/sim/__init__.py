"""The simulated device (`--device sim --sim-profile h100-llama3-8b`): the engine's real
scheduler, KV manager, sampler bookkeeping, detokeniser and serving path around a model step
whose time comes from a roofline model of a GPU (`roofline.py`) instead of running a model,
so the host overhead a fast device would expose can be measured on a machine without one.

    profile.py   SimProfile: the device (bandwidth, peak, launch cost, memory) and the model's
                 shapes, from plain YAML (`profiles/*.yaml`, or a path)
    roofline.py  one step's modelled seconds from the batch's real rows and contexts
    device.py    SimDevice: launch returns at once, reading a step's results waits for its
                 modelled end; the busy seconds it modelled
    runner.py    SimRunner: the model runner's interface over the simulated device, seeded
                 random tokens (text is nonsense; lengths follow max_tokens)
"""
