"""Generated protobuf/gRPC stubs of splitserve's wire protocol (sources in ``proto/``)."""
