"""gpu-swarm: AWS GPU instances as a Docker Swarm in which every GPU is a schedulable generic resource."""
import pulumi

from components import collector
from components.cluster import Cluster, ClusterArgs
from settings import load_settings

collector.for_a_large_graph()  # before the graph: its objects live until the end (components/collector.py)
settings = load_settings()  # raises SettingsError, listing every problem, before anything exists
cluster = Cluster("gpu-swarm", ClusterArgs(settings=settings))

pulumi.export("managerPublicIps", cluster.manager_public_ips)
pulumi.export("managerPrivateIps", cluster.manager_private_ips)
pulumi.export("sshCommands", cluster.ssh_commands)
# The nodes' host keys, which every connection of the program pins:
# `pulumi stack output knownHosts > gpu-swarm.known_hosts`, then ssh -o UserKnownHostsFile=gpu-swarm.known_hosts
pulumi.export("knownHosts", cluster.known_hosts)
pulumi.export("inventory", cluster.inventory)
pulumi.export("bootstrapTimings", cluster.bootstrap_timings)
pulumi.export("nodeSoftware", cluster.node_software)
pulumi.export("availabilityZones", cluster.availability_zones)
pulumi.export("vpcId", cluster.vpc_id)
# Each stack as deployed: the hash of the file swarm gets (its Compose GPU requests rewritten) and each rewrite.
pulumi.export("stacks", {s.name: {"file": s.file, "sha256": s.sha256, "rewrites": list(s.info.rewrites),
                                  "warnings": list(s.info.warnings)} for s in settings.stacks})
# Per stack, once its deploy settled: each service's tasks, and the tasks waiting for GPUs with the scheduler's reason.
pulumi.export("stackTasks", cluster.stack_tasks)
# What the cluster's instances cost per hour at AWS's list prices, read at this preview; `table` as it printed.
pulumi.export("cost", cluster.cost)
pulumi.export("monitoring", cluster.monitoring)  # the SSH tunnel to Grafana and Prometheus (monitoring: true)
if cluster.private_key is not None:
    # Secret: `pulumi stack output privateKey --show-secrets > gpu-swarm.key && chmod 600 gpu-swarm.key`
    pulumi.export("privateKey", cluster.private_key)
