#!/bin/sh
# Rendered by bcm (lab node gpu02 of prod): kwok simulates this node's kubelet, so the
# node goes NotReady when this machine dies.
exec /usr/local/lib/bcm-k8s/bin/kwok --kubeconfig=/etc/bcm-k8s/kwok.kubeconfig --manage-all-nodes=false \
  --manage-single-node=gpu02 --cidr=198.19.65.0/24 --node-ip=198.18.50.22 \
  --node-lease-duration-seconds=20 --config=/etc/bcm-k8s/kwok-stages.yaml
