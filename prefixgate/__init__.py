"""The `prefixgate` command: the one place that composes the gateway and its replicas."""
