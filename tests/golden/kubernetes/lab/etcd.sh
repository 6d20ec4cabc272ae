#!/bin/sh
# Rendered by bcm (lab control plane of prod): etcd, reachable only on the node's loopback.
exec /usr/local/lib/bcm-k8s/bin/etcd --name=cp01 --data-dir=/var/lib/bcm-k8s/etcd \
  --listen-client-urls=http://127.0.0.1:2379 --advertise-client-urls=http://127.0.0.1:2379 \
  --listen-peer-urls=http://127.0.0.1:2380 --initial-advertise-peer-urls=http://127.0.0.1:2380 \
  --initial-cluster=cp01=http://127.0.0.1:2380 --listen-metrics-urls=http://127.0.0.1:2381 \
  --auto-compaction-retention=1 --unsafe-no-fsync
