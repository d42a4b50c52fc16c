"""The Ray Data side of kivi-ray: job config, input/output, the actor and the run loop."""
