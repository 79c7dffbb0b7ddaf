"""Training engines that own the step (precision, optimizer, sharding): shared by the techniques
that select them. Not techniques themselves."""
