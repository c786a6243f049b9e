"""Pods: CRI checkpoint archives, the container's writable layer, joining the new sandbox's namespaces."""
