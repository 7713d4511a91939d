"""Training: reader -> target workers -> feature queues -> drafter replicas -> optimizer, in two runtimes."""
