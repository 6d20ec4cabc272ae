#!/bin/sh
# Rendered by bcm (lab control plane of prod).
exec /usr/local/lib/bcm-k8s/bin/kube-controller-manager --kubeconfig=/etc/bcm-k8s/controller-manager.kubeconfig \
  --authentication-kubeconfig=/etc/bcm-k8s/controller-manager.kubeconfig \
  --authorization-kubeconfig=/etc/bcm-k8s/controller-manager.kubeconfig \
  --bind-address=127.0.0.1 --leader-elect=false --use-service-account-credentials=true \
  --root-ca-file=/etc/bcm-k8s/ca.crt --service-account-private-key-file=/etc/bcm-k8s/sa.key \
  --cluster-signing-cert-file=/etc/bcm-k8s/ca.crt --cluster-signing-key-file=/etc/bcm-k8s/ca.key \
  --node-monitor-period=2s --node-monitor-grace-period=20s --profiling=false
