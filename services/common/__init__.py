"""What every splitserve service shares: gRPC plumbing, proto conversions, TLS, logging and
metrics. The workers' own runtime is ``services.worker``."""
