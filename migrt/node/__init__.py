"""This node's set-up and diagnosis: containerd runtime handler install, `migrt doctor`."""
