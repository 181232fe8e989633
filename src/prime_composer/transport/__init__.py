"""Moving data between processes: batches orchestrator -> trainer, weights trainer -> inference."""
