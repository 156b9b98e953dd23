"""The ground floor: distributed set-up, crash-safe files, torch.compile's cache folder, DeepSpeed
configs, optimizers, ZeRO-3 parameter helpers, throughput numbers, running averages and the imports
kept out of start-up. Imports nothing of dschat above it."""
