"""A Ray node that believes it has 8 CPUs, started as `prefixgate serve --replicas` starts one:
idle workers counted the old way (any that never ran anything) and the new way (started with
our actors' runtime env), then the keeper run until a spare of ours registers."""
import sys, time, threading
sys.path.insert(0, ".")
import ray
from replicas.app import OWN_CLUSTER
from replicas.spare_worker import SpareWorkerConfig, SpareWorkerKeeper, started_for_our_actors

ray.init(num_cpus=int(sys.argv[1]) if len(sys.argv) > 1 else 8, include_dashboard=False,
         _system_config=OWN_CLUSTER, log_to_driver=False)
time.sleep(8)  # Ray's prestarts register
k = SpareWorkerKeeper.for_this_node(SpareWorkerConfig(interval=0.5))
old = SpareWorkerKeeper.for_this_node(SpareWorkerConfig())
old._ours = lambda pid: True
print("idle workers, old count:", old.idle_workers(), "new count:", k.idle_workers())
stop = threading.Event()
t = threading.Thread(target=k.run, args=(stop,), daemon=True); t.start()
deadline = time.time() + 40
while time.time() < deadline and k.idle_workers() < 1:
    time.sleep(0.5)
stop.set()
print("spares asked for:", k.started, "idle workers of ours now:", k.idle_workers(), "old count:", old.idle_workers())
ray.shutdown()
