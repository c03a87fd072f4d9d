"""What every splitserve server shares: the engine thread, gRPC plumbing, proto conversions."""
