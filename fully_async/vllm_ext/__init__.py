"""Code that runs inside the engine's own interpreter (its venv), not ours: put on the engine's PYTHONPATH as a
directory, each module here imports only the standard library, torch, safetensors and the engine itself."""
