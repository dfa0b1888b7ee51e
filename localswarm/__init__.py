"""The local rehearsal: a real multi-node Docker Swarm with simulated GPUs on one machine."""
