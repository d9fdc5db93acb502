"""Built-in tasks with verifiable rewards."""
