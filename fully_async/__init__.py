"""fully_async: fully asynchronous, decoupled rollout/trainer RL for LLMs on Ray."""
