"""What the program sends to a node: the software release (software.py: bundle, settings, the
files cloud-init writes) and the scripts it runs there over SSH (commands.py). node/ is what
runs on the node; this package is the program's side of that contract."""
