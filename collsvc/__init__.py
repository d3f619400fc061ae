"""collsvc: collective communication for distributed training."""
