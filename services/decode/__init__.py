"""The decode worker: pulls prefilled KV, continues requests in its running batch."""
