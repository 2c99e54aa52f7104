"""Reinforcement learning (report section 3.2): environments, verifiable tasks, critic, K1.5 loss, colocated loop."""
