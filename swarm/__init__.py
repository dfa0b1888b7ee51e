"""What runs on the swarm: the shell commands that form it and the checks on stack files."""
