"""Pulumi components: the AWS resources and the swarm built on them, one component per file."""
