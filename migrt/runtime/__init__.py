"""The lower runtime (runc, crun, nvidia-container-runtime): finding it and its state root (lower,
stdlib only: the hot path), runc's command line and the typed call the shim hands its handlers (argv,
stdlib only too), running it as a child (runc, control), its log format (runclog) and migrt's restore
marker in its state directory (markers)."""
