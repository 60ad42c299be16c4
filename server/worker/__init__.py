"""What a router in front of several replicas asks each of them (server/worker/router.py)."""
