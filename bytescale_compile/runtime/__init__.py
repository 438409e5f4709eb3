"""What runs the compiled graphs: the micro-batch context the custom ops read."""
