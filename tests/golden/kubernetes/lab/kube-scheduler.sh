#!/bin/sh
# Rendered by bcm (lab control plane of prod).
exec /usr/local/lib/bcm-k8s/bin/kube-scheduler --kubeconfig=/etc/bcm-k8s/scheduler.kubeconfig \
  --authentication-kubeconfig=/etc/bcm-k8s/scheduler.kubeconfig \
  --authorization-kubeconfig=/etc/bcm-k8s/scheduler.kubeconfig \
  --bind-address=127.0.0.1 --leader-elect=false --profiling=false
