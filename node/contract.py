"""The contract between the program and the nodes: every label, environment key and node path, once.

Like NVIDIA k8s-device-plugin's constants, each name is defined here and imported everywhere:
node programs import it as a sibling (it lands on every node with them), the program loads
it by path (swarm/node_contract.py). Each comment says who writes the thing and who reads it.
Shell cannot import Python: node/common.sh, the units and gpu-swarm-runtime spell the same
values, and tests/test_node_contract.py keeps them equal. The runtime guard (gpu_guard.py, with
its siblings guard_files.py and guard_efa.py) imports nothing else of ours, as it runs at every
container start and must fail closed; it reads its settings from the path it is given (the
ledger's and the MPS directory's among them). Stdlib only, and no imports at all.
"""

# ---------------------------------------------------------------- node labels (docker node update)
# On the swarm's node objects: only managers can set them, so a node cannot vouch for itself.
LABEL_PREFIX = "gpu-swarm."  # every label below starts with it; the program owns them all
# The pool labels: components/cluster.py sets them when a node is admitted (swarm/rollout.py
# admit_node); placement constraints read them (node.labels.gpu-swarm.pool == training).
POOL_LABEL = "gpu-swarm.pool"  # the node's pool; swarm/reconcile.py finds the program's nodes by it
POOL_INSTANCE_TYPE_LABEL = "gpu-swarm.instance-type"  # the pool's EC2 instance type
POOL_GPU_MODEL_LABEL = "gpu-swarm.gpu-model"  # the pool's GPU model, as settings/ names it (H100)
POOL_GPU_COUNT_LABEL = "gpu-swarm.gpu-count"  # GPUs per node of the pool
POOL_SPOT_LABEL = "gpu-swarm.spot"  # "true" or "false"
POOL_SLOTS_PER_GPU_LABEL = "gpu-swarm.slots-per-gpu"  # tasks per shared GPU; 0: whole GPUs
# The node's state, between the program's scripts and the reconciler on the managers.
SOFTWARE_LABEL = "gpu-swarm.software"  # the release the node runs: rollout admit_node writes, cordon_node reads
MAINTENANCE_LABEL = "gpu-swarm.maintenance"  # "<since>:<release>": rollout's cordon_node writes it while the
# node's software changes, admit_node removes it; swarm_reconciler.py gives no such node back
DRAINED_BY_LABEL = "gpu-swarm.drained-by"  # who drained the node, one of the four below; none: an operator.
# Each drainer makes active only nodes it drained itself; swarm/health.py reports it.
DRAINED_BY_ROLLOUT = "rollout"  # swarm/rollout.py cordon_node; admit_node undoes it
DRAINED_BY_GPU_CHECK = "gpu-check"  # swarm/gpu_check.py, when the node failed the check; admit_node undoes it
DRAINED_BY_HEALTH = "health"  # node/swarm_reconciler.py, on a fault; it undoes it itself once healthy
DRAINED_BY_AUTOSCALE = "autoscale"  # node/swarm_scaler.py, removing an idle node of an elastic pool (or giving it back)
VERIFIED_LABEL = "gpu-swarm.gpus-verified"  # the release whose GPUs swarm/gpu_check.py last proved; it reads it
HEALTH_LABEL = "gpu-swarm.health"  # "<condition>:<reason>": swarm_reconciler.py writes while it holds the
# node drained; swarm/health.py and the rehearsal's status read it
HEALTH_LAST_LABEL = "gpu-swarm.health.last"  # "drained|reactivated:<time>:<why>": the reconciler's last action

# ---------------------------------------------------------------- engine labels (daemon.json "labels")
# Set by the node about itself; dockerd reloads them on SIGHUP, and every manager sees them.
CONDITION_LABEL = "gpu-swarm.condition"  # healthy, degraded, unhealthy or reclaim: node/gpu_health.py writes
# it and the three below (it owns every label that starts with it); swarm_reconciler.py drains on it,
# swarm/health.py and the rehearsal's status read them all
CONDITION_REASON_LABEL = f"{CONDITION_LABEL}.reason"  # why, in [A-Za-z0-9._:/-]: xid_79_on_GPU-...
CONDITION_GPU_LABEL = f"{CONDITION_LABEL}.gpu"  # the GPU that set the condition; "-" for none
CONDITION_SINCE_LABEL = f"{CONDITION_LABEL}.since"  # unix time the condition began
# The conditions swarm_reconciler.py drains a node on; gpu_health.py signals the node's sentinel
# task as its condition enters one, so the reconciler acts before the label arrives.
DRAIN_CONDITIONS = ("unhealthy", "reclaim")
# What the node's GPUs are, named as gpu-feature-discovery names them: node/gpu_agent.py
# (gpu_detect.py) writes them at every boot and owns every label that starts with "gpu.";
# placement constraints read them (engine.labels.gpu.product == NVIDIA-H100-80GB-HBM3).
GPU_LABEL_PREFIX = "gpu."  # the agent's labels
GPU_COUNT_LABEL = "gpu.count"  # GPUs NVML sees
GPU_PRODUCT_LABEL = "gpu.product"  # the first GPU's name, spaces as dashes
GPU_MEMORY_LABEL = "gpu.memory"  # the first GPU's memory, MiB
GPU_DRIVER_LABEL = "gpu.driver"  # the driver version, when NVML says
GPU_CUDA_LABEL = "gpu.cuda"  # the CUDA version the driver supports, when NVML says
GPU_COMPUTE_LABEL = "gpu.compute"  # the first GPU's compute capability, when NVML says
GPU_SHARING_LABEL = "gpu.sharing"  # time-slicing, or refused-compute-mode; only on a pool that shares GPUs
GPU_REPLICAS_LABEL = "gpu.replicas"  # slots per GPU; only on a pool that shares GPUs
# The node's EFA interfaces: node/gpu_agent.py (efa_detect.py) writes it at every boot, only on a
# node that has EFA, and owns every label that starts with EFA_LABEL_PREFIX; multi-node jobs
# place on it (engine.labels.efa.count == 32).
EFA_LABEL_PREFIX = "efa."
EFA_COUNT_LABEL = "efa.count"  # EFA devices the kernel shows (/sys/class/infiniband, driver efa)
# The generic-resource kind of EFA devices: the agent advertises each as AWS-EFA=<device> (rdmap16s27) beside the
# GPUs; a stack reserves a count of it (swarm/stack_files.py checks it against the pools); swarm names the devices
# it assigned in DOCKER_RESOURCE_AWS-EFA, and the guard gives the task their /dev/infiniband devices.
EFA_KIND = "AWS-EFA"

# What the runtime guard says when it refuses a container a GPU (or slot) that a running container
# holds: "gpu-swarm guard: GPU <uuid> is held by container <id> ...". gpu_guard.py spells it itself
# (tests/test_gpu_guard_ledger.py keeps it equal); swarm/gpu_check.py reads it
# in a task's error: swarm gave that GPU away, which its scheduler does after a leader change.
GPU_HELD = "is held by container"

# Elastic pools (settings/pool_autoscale.py). An elastic node joins by itself (node/swarm_join.py), and writes two
# engine labels first (daemon.json "labels"); the leader's scaler (node/swarm_scaler.py) reads them to find the
# node's instance, and believes them only for an instance that the pool's Auto Scaling group lists, claimed by no
# other node. Engine labels are the node's own word, so the scaler sets the pool labels above only once it has.
INSTANCE_ID_LABEL = "gpu-swarm.instance-id"  # engine label: the node's EC2 instance id, from IMDS
ELASTIC_POOL_LABEL = "gpu-swarm.elastic-pool"  # engine label: the pool whose group launched it (its node.env)
# Node labels the scaler keeps on the swarm's node objects, so that a new leader's scaler reads what the last one did.
IDLE_SINCE_LABEL = "gpu-swarm.idle-since"  # unix time since which the admitted node has held no GPU task
AUTOSCALE_LABEL = "gpu-swarm.autoscale"  # "<goal>:<phase>:<since>" while the scaler takes the node out: goal
# remove (the group shrinks) or replace (outdated software: the group launches another), phase paused, draining
# or terminating
AUTOSCALE_STATUS_LABEL = "gpu-swarm.autoscale.status"  # on the leader's own node: each elastic pool's nodes
# wanted, booting and ready, and its last decision, as JSON; `localswarm program status` and swarm/health.py read it

# ---------------------------------------------------------------- labels on other swarm objects
# The program's own; no node program reads them, but every gpu-swarm label lives here.
STACK_NAMESPACE_LABEL = "com.docker.stack.namespace"  # Docker's, not ours: `docker stack deploy` puts it on
# each service, task container, network and config of a stack; node/stack_settle.py and swarm/ find a stack's parts by it
CHECK_SERVICE_LABEL = "gpu-swarm.check"  # on swarm/gpu_check.py's one-off services: the node it checks
STACK_LABEL = "gpu-swarm.stack"  # swarm/stacks.py marks each stack it deploys with a config named
# "<STACK_LABEL>.<stack>" and labelled with it; swarm/reconcile.py removes the stacks whose marker it no longer wants
MONITORING_STACK = "gpu-swarm-monitoring"  # the stack components/monitoring.py deploys (monitoring: true);
# settings/ keeps users' stacks off the name, swarm/reconcile.py removes it with the other stacks once it is off
CHECK_IMAGE = "gpu-swarm.invalid/check:1"  # node/build-check-image.sh builds it on each GPU node (never
# pulled: the registry does not exist); swarm/gpu_check.py runs it
SENTINEL_SERVICE = "gpu-swarm-sentinel"  # a global service, one task on each worker, that swarm_reconciler.py
# creates on the leader (CHECK_IMAGE, no GPU). gpu_health.py sends its task SENTINEL_SIGNAL on a fault, the task
# exits SENTINEL_EXIT, and swarm reports that to the managers at once: an engine label waits for the agent's 20 s tick
SENTINEL_SIGNAL = "USR1"
SENTINEL_EXIT = 75  # nothing else in the sentinel exits so
SIGNALLED_LABEL = "gpu-swarm.health.signalled"  # node label, "<time>": swarm_reconciler.py drained the node on
# its sentinel, before the engine labels said why; it holds the drain until they catch up

# ---------------------------------------------------------------- node.env: the node's settings
# The program (to_node/software.py node_env) writes them to NODE_ENV_PATH; every step sources it
# (common.sh) and the units load it. A change rolls the node.
IMAGE_ENV = "GPU_SWARM_IMAGE"  # ubuntu, deep-learning or custom: install-nvidia-driver.sh reads
KIND_ENV = "GPU_SWARM_KIND"  # the GPU resource kind: the agent's and the watcher's units read
KERNEL_MODULES_ENV = "NVIDIA_KERNEL_MODULES"  # open or proprietary (GPU nodes): install-nvidia-driver.sh reads
SLOTS_PER_GPU_ENV = "GPU_SWARM_SLOTS_PER_GPU"  # tasks per shared GPU (pools that share): the agent reads
SHARED_KIND_ENV = "GPU_SWARM_SHARED_KIND"  # the shared slots' kind (with the above): the agent and the watcher read
SHARING_MODE_ENV = "GPU_SWARM_SHARING_MODE"  # "mps" on pools that share by MPS (unset: time-slicing): install-mps.sh,
# the agent and the watcher read
SPOT_ENV = "GPU_SWARM_SPOT"  # an override the program never writes: true or false; unset, the watcher watches
# for reclaim notices when IMDS's instance-life-cycle says spot (a node keeps its market when its pool's changes)
EFA_ENV = "GPU_SWARM_EFA_INTERFACES"  # EFA interfaces the instance type has (EFA pools): install-efa.sh checks the
# node shows that many
AGENT_ARGS_ENV = "GPU_SWARM_AGENT_ARGS"  # extra agent flags: an operator's unit drop-in sets it; the agent's unit reads
JOIN_PARAMETER_ENV = "GPU_SWARM_JOIN_PARAMETER"  # an elastic pool's nodes: the SSM parameter (SecureString) that
# holds the swarm's worker token and the managers' addresses; swarm_join.py reads it with the pool's instance role
JOIN_DOCUMENT_KEYS = ("token", "managers", "cluster")  # the parameter's JSON value: components/elastic_pool.py
# writes the worker token, the managers' private addresses and the swarm's cluster id; swarm_join.py reads them
ELASTIC_POOL_ENV = "GPU_SWARM_ELASTIC_POOL"  # an elastic pool's nodes: the pool; join-swarm.sh writes it as the
# ELASTIC_POOL_LABEL engine label
REGION_ENV = "GPU_SWARM_REGION"  # an elastic pool's nodes and the managers of a cluster with one: the AWS region
# whose endpoints node/aws_api.py calls

# ---------------------------------------------------------------- health.env: the health settings
# The program (settings.Health.node_env) writes them to HEALTH_ENV_PATH and restarts the two
# health units; a change drains nothing.
HEALTH_IGNORE_XIDS_ENV = "HEALTH_IGNORE_XIDS"  # XIDs to ignore besides the defaults: the watcher reads
HEALTH_CRITICAL_XIDS_ENV = "HEALTH_CRITICAL_XIDS"  # XIDs never to ignore: the watcher reads
HEALTH_INTERVAL_ENV = "HEALTH_INTERVAL_SECONDS"  # seconds between checks: the watcher reads
HEALTH_RECOVERY_ENV = "HEALTH_RECOVERY_SECONDS"  # passing checks that clear an event: the watcher reads
HEALTH_MAX_DRAINED_PERCENT_ENV = "HEALTH_MAX_DRAINED_PERCENT"  # drained for faults at once: the reconciler reads
# A capacity-block pool's nodes: the block's end (RFC 3339). The watcher drains the node ahead of it; an
# extended block is a new end here, and so only a restart of the watcher.
CAPACITY_BLOCK_END_ENV = "HEALTH_CAPACITY_BLOCK_END"

# ---------------------------------------------------------------- cost.env: what the node costs
# The program (components/cost.py, to_node/software.py price_env) writes them to COST_ENV_PATH on every GPU
# node, as the preview priced it, with health.env; the metrics exporter reads the file again whenever it
# changes, so a new price (spot prices move every day) restarts nothing and drains nothing.
PRICE_ENV = "GPU_SWARM_PRICE_PER_HOUR"  # USD per hour, AWS's list price; empty: not known: the exporter reads
PRICE_MARKET_ENV = "GPU_SWARM_PRICE_MARKET"  # on-demand, spot, reserved or capacity-block: the exporter reads
PRICE_DATE_ENV = "GPU_SWARM_PRICE_DATE"  # when AWS set the price (RFC 3339): the exporter reads
PRICE_INSTANCE_TYPE_ENV = "GPU_SWARM_PRICE_INSTANCE_TYPE"  # the instance type priced: the exporter reads
PRICE_GPUS_ENV = "GPU_SWARM_PRICE_GPUS"  # the instance type's GPUs, which share its price equally: the exporter reads

# ---------------------------------------------------------------- release.env: what the installer installs
# The program writes them to RELEASE_ENV_PATH (cloud-init at first boot, an upgrade later);
# the installer (INSTALLER_PATH) reads them.
BUNDLE_URL_ENV = "GPU_SWARM_BUNDLE_URL"  # where the node software bundle is
BUNDLE_SHA256_ENV = "GPU_SWARM_BUNDLE_SHA256"  # its sha256, checked before anything of it runs
STEPS_ENV = "GPU_SWARM_STEPS"  # the bootstrap steps, in order: node/<step>.sh
RELEASE_ENV = "GPU_SWARM_RELEASE"  # the release id, written to APPLIED once it is applied

# ---------------------------------------------------------------- node paths
NODE_DIR = "/opt/gpu-swarm"  # everything gpu-swarm installs
SOFTWARE_DIR = f"{NODE_DIR}/software"  # node/, as the installer installs it; the units run from it
NODE_VERSIONS_ENV = f"{SOFTWARE_DIR}/versions.env"  # node/versions.env: common.sh sources it
AGENT_PATH = f"{SOFTWARE_DIR}/gpu_agent.py"  # gpu-swarm-agent.service runs it
WATCHER_PATH = f"{SOFTWARE_DIR}/gpu_health.py"  # gpu-swarm-health.service runs it
RECONCILER_PATH = f"{SOFTWARE_DIR}/swarm_reconciler.py"  # gpu-swarm-reconciler.service runs it
IMDS_FIREWALL_PATH = f"{SOFTWARE_DIR}/imds-root-only.sh"  # gpu-swarm-imds.service runs it at every boot
METRICS_PATH = f"{SOFTWARE_DIR}/gpu_metrics.py"  # gpu-swarm-metrics.service runs it
STACK_SETTLE_PATH = f"{SOFTWARE_DIR}/stack_settle.py"  # the stack deploy command (swarm/stacks.py) runs it on
# the first manager, right after `docker stack deploy`; stdlib only
TOP_PATH = f"{SOFTWARE_DIR}/gpu_top.py"  # an operator runs it on a manager (README "GPU metrics"); stdlib only
GUARD_PATH = f"{SOFTWARE_DIR}/gpu-swarm-runtime"  # the agent makes it dockerd's default runtime (daemon.json)
AGENT_VENV = f"{NODE_DIR}/venv"  # install-gpu-agent.sh creates it (pynvml, prometheus_client); the agent's, the
# watcher's and the exporter's units run it
WHEELHOUSE = f"{NODE_DIR}/wheels"  # an image may carry the venv's pinned wheels here (by their PyPI file names):
# install-agent-venv.sh then installs them without a download. The rehearsal's image does (localswarm/standins)
CONFIG_DIR = "/etc/gpu-swarm"  # the node's settings
NODE_ENV_PATH = f"{CONFIG_DIR}/node.env"  # the program writes (see node.env above); steps and units read
HEALTH_ENV_PATH = f"{CONFIG_DIR}/health.env"  # the program writes (see health.env above); the health units read
COST_ENV_PATH = f"{CONFIG_DIR}/cost.env"  # the program writes (see cost.env above); the metrics exporter reads
RELEASE_ENV_PATH = f"{CONFIG_DIR}/release.env"  # the program writes (see release.env above); the installer reads
RUNTIME_ENV_PATH = f"{CONFIG_DIR}/runtime.env"  # the agent writes the guard's settings; gpu-swarm-runtime and
# gpu_guard.py read it (daemon.json passes its path to the runtime)
# Two of its keys, on a node that advertises EFA devices (the guard imports nothing of ours and spells them
# itself; tests/test_efa_devices.py runs the agent's file through the guard):
RUNTIME_EFA_KIND_KEY = "EFA_KIND"  # EFA_KIND above: the guard reads DOCKER_RESOURCE_<it> in each task
RUNTIME_EFA_DEVICES_KEY = "EFA_DEVICES"  # <device>:/dev/infiniband/uverbsN,...: the agent finds each device's
# verbs node at boot, so the guard's create only stats the ones a task was given
INSTALLER_PATH = "/usr/local/sbin/gpu-swarm-install"  # the program writes it; cloud-init and upgrades run it
UNATTENDED_CONFIG = "/etc/apt/apt.conf.d/51gpu-swarm-unattended"  # the program writes; unattended-upgrades reads
SSHD_CONFIG = "/etc/ssh/sshd_config.d/60-gpu-swarm.conf"  # the program writes, before sshd first starts; sshd reads
NVLSM_MODULES_CONF = "/etc/modules-load.d/gpu-swarm-nvlsm.conf"  # install-nvlink-subnet-manager.sh writes it
# (ib_umad at every boot, for the NVLink Subnet Manager of p6-b200/b300); systemd-modules-load reads it
LOG_DIR = "/var/log/gpu-swarm"  # the installer and the steps log here
BOOTSTRAP_LOG = f"{LOG_DIR}/bootstrap.log"  # the installer and every step append; the program tails it on failure
STATE_DIR = "/var/lib/gpu-swarm"  # what the node remembers across boots
BOOTSTRAP_TIMINGS = f"{STATE_DIR}/bootstrap-timings.json"  # bootstrap.sh writes each step's time; the program prints it
INSTALL_TIMINGS = f"{STATE_DIR}/install-timings.json"  # the installer writes its own step's time; the program prints it
# Exactly one of these two exists once an install has ended (bootstrap.sh writes them, the
# program reads them). Neither: still running, or it never ran.
BOOTSTRAP_DONE = f"{STATE_DIR}/bootstrap-done"  # the install finished
BOOTSTRAP_FAILED = f"{STATE_DIR}/bootstrap-failed"  # it failed; holds the failed step's name
APPLIED = f"{STATE_DIR}/applied"  # the release last applied: the installer writes, the program compares
HEALTH_STATE_PATH = f"{STATE_DIR}/health-state.json"  # the watcher's events across its restarts; only it reads
AGENT_REPORT_PATH = "/run/gpu-swarm/report.json"  # the agent's unit writes its JSON report, and reads it to
# decide whether docker must restart
GUARD_LEDGER_PATH = "/run/gpu-swarm/gpu-claims"  # which container holds which GPU or slot: the guard (gpu_guard.py)
# writes and reads it, under <path>.lock; the agent passes its path in runtime.env. Gone at reboot, as the holders are
MPS_DIR = "/run/gpu-swarm/mps"  # <uuid>/pipe and <uuid>/log of each GPU's MPS control daemon: gpu-swarm-mps starts
# them there, the pipe folder in a mount namespace of the daemon's own (outside it, an empty folder)
MPS_DAEMON_PID = "daemon.pid"  # <MPS_DIR>/<uuid>/daemon.pid: gpu-swarm-mps names the GPU's daemon there (its own pid
# file is in its private pipe folder); the guard, the relay and the watcher read it
MPS_NAMESPACE = "namespace"  # <MPS_DIR>/<uuid>/namespace: the daemon's mount namespace (mnt:[inode]); what is
# killed, by pid, when the daemon or its server is stuck (gpu-swarm-mps stop, the watcher)
MPS_LAST_CLIENTS = "last-clients"  # <MPS_DIR>/<uuid>/last-clients: mps_relay.py writes the last tasks that got a
# descriptor to the GPU's MPS server (OUTBCUFD), as JSON lines; the watcher names the one before a stall
MPS_RELAY_MAX_CONNECTIONS = 4000  # task connections mps_relay.py holds at once (gpu-swarm-mps.service: LimitNOFILE)
MPS_RELAY_PER_CONTAINER = 64  # of those, one container's (or one host cgroup's): a flood of more is closed at once
MPS_TASK_DIR = "tasks"  # <MPS_DIR>/<uuid>/tasks/control: mps_relay.py's socket, which passes CUDA clients to the
# daemon's pipe/control and refuses control commands; the guard mounts this folder (read-only) where a slot task's
# CUDA_MPS_PIPE_DIRECTORY points, never the daemon's pipe
MPS_RELAY_PID = "relay.pid"  # <MPS_DIR>/relay.pid: mps_relay.py names itself there; gpu-swarm-mps stops it, the
# guard refuses a slot task while it is not running
MPS_RELAY_PATH = f"{SOFTWARE_DIR}/mps_relay.py"  # gpu-swarm-mps starts it after the daemons
MPS_RELAY_LOG = "relay.log"  # <MPS_DIR>/relay.log: gpu-swarm-mps sends mps_relay.py's output there (each refusal)
MPS_SCRIPT_PATH = f"{SOFTWARE_DIR}/gpu-swarm-mps"  # gpu-swarm-mps.service runs it (start, stop)
GUARD_SERVER_DIR = "/run/gpu-swarm/guard"  # the guard's server (guard_server.py) listens on <dir>/requests and
# names itself in <dir>/server.pid; the agent writes it to runtime.env as GUARD_SERVER; gpu-swarm-runtime reads both
GUARD_SERVER_PATH = f"{SOFTWARE_DIR}/guard_server.py"  # gpu-swarm-guard.service runs it
AUTOSCALE_DIR = f"{CONFIG_DIR}/autoscale"  # the program writes it on every manager (to_node/commands.py
# autoscale_settings); the scaler reads it at each round, so a change restarts nothing
AUTOSCALE_POOLS_PATH = f"{AUTOSCALE_DIR}/pools.json"  # each elastic pool: its group, bounds, GPUs and labels
AUTOSCALE_ADMIT_SUFFIX = ".admit.sh"  # <AUTOSCALE_DIR>/<pool>.admit.sh NODE_ID: swarm/rollout.py's admit_node for
# any node of the pool, the same post-join GPU check a fixed node gets; the scaler runs it
SCALER_PATH = f"{SOFTWARE_DIR}/swarm_scaler.py"  # gpu-swarm-scaler.service runs it on every manager
JOIN_PATH = f"{SOFTWARE_DIR}/swarm_join.py"  # join-swarm.sh runs it, the last step of an elastic node's boot
# Other programs' files that ours write or read:
DOCKER_DAEMON_JSON = "/etc/docker/daemon.json"  # the agent (resources, gpu.* labels, runtimes) and the watcher
# (condition labels) write their keys; dockerd reads; the program counts the advertised resources
DOCKER_SOCKET = "/var/run/docker.sock"  # dockerd listens; swarm/script.py's join posts to it when DOCKER_HOST is unset
# Docker's labels on every task's container: the metrics exporter (gpu_tasks.py) reads them to name a GPU's holder.
DOCKER_SERVICE_NAME = "com.docker.swarm.service.name"  # dockerd sets it: the service, as the stack named it
DOCKER_TASK_NAME = "com.docker.swarm.task.name"  # dockerd sets it: <service>.<slot>.<task id>
DOCKER_TASK_ID = "com.docker.swarm.task.id"  # dockerd sets it on task containers only: the exporter filters on it
DOCKERD_PIDFILE = "/var/run/docker.pid"  # dockerd writes; the watcher reads, to SIGHUP it after a label change
TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"  # the agent sets swarm-resource; the toolkit reads
EFA_SYSFS = "/sys/class/infiniband"  # the kernel lists RDMA devices, EFA among them: efa_detect.py reads
EFA_VERBS_DIR = "/dev/infiniband"  # each RDMA device's user verbs node (uverbsN), which libibverbs opens: the
# agent maps EFA devices to them, the guard gives a task those of the devices it reserved
EFA_INSTALLER_DIR = "/opt/amazon/efa"  # aws-efa-installer installs libfabric and its tools here: install-efa.sh reads
CLOUD_INIT_LOG = "/var/log/cloud-init-output.log"  # cloud-init writes the first boot's output; the program tails it
CLOUD_INIT_STATUS = "/var/lib/cloud/data/status.json"  # cloud-init writes each stage's times and errors; the program reads
CLOUD_INIT_RESULT = "/run/cloud-init/result.json"  # cloud-init writes it when its last stage ends (in /run: this boot's);
# the program waits for the first boot on it

# ---------------------------------------------------------------- units
AGENT_UNIT = "gpu-swarm-agent.service"  # install-gpu-agent.sh installs it; runs before docker at every boot
HEALTH_UNIT = "gpu-swarm-health.service"  # install-health-watcher.sh installs it on GPU nodes
RECONCILER_UNIT = "gpu-swarm-reconciler.service"  # install-reconciler.sh installs it on managers
SCALER_UNIT = "gpu-swarm-scaler.service"  # install-reconciler.sh installs it on managers; idle without elastic pools
MPS_UNIT = "gpu-swarm-mps.service"  # install-mps.sh installs it on pools that share by MPS; before the agent and docker
GUARD_UNIT = "gpu-swarm-guard.service"  # install-gpu-agent.sh installs it on GPU nodes; before docker
METRICS_UNIT = "gpu-swarm-metrics.service"  # install-gpu-metrics.sh installs it on GPU nodes
IMDS_UNIT = "gpu-swarm-imds.service"  # secure-imds.sh installs it on every node: IMDS for root only, at every boot
INSTALL_UNIT = "gpu-swarm-install"  # the transient unit the program runs the installer in

# ---------------------------------------------------------------- ports
# The metrics exporter (gpu_metrics.py) listens on it on every GPU node; components/security_groups.py
# opens it to cluster members only; stacks/monitoring/prometheus.yml scrapes it (a test keeps them equal).
METRICS_PORT = 9835

# ---------------------------------------------------------------- the shell's own names for these paths
# node/common.sh defaults each variable to the path (tests point them into a scratch folder);
# tests/test_node_contract.py checks that the defaults are these paths.
SCRIPT_PATH_VARS = {
    "GPU_SWARM_LOG": BOOTSTRAP_LOG,
    "GPU_SWARM_STATE": STATE_DIR,
    "GPU_SWARM_VERSIONS": NODE_VERSIONS_ENV,
    "GPU_SWARM_NODE_ENV": NODE_ENV_PATH,
    "GPU_SWARM_VENV": AGENT_VENV,
    "GPU_SWARM_WHEELHOUSE": WHEELHOUSE,
    "DOCKER_DAEMON_JSON": DOCKER_DAEMON_JSON,
}
CHECK_IMAGE_VAR = "GPU_SWARM_CHECK_IMAGE"  # build-check-image.sh: the image to build (default CHECK_IMAGE)
