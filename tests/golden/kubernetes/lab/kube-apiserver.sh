#!/bin/sh
# Rendered by bcm (lab control plane of prod): the API server on the lab bridge address only.
exec /usr/local/lib/bcm-k8s/bin/kube-apiserver --etcd-servers=http://127.0.0.1:2379 \
  --bind-address=198.18.50.11 --advertise-address=198.18.50.11 --secure-port=6443 \
  --endpoint-reconciler-type=none --allow-privileged=true --authorization-mode=Node,RBAC \
  --tls-cert-file=/etc/bcm-k8s/apiserver.crt --tls-private-key-file=/etc/bcm-k8s/apiserver.key \
  --client-ca-file=/etc/bcm-k8s/ca.crt \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file=/etc/bcm-k8s/sa.pub --service-account-signing-key-file=/etc/bcm-k8s/sa.key \
  --service-cluster-ip-range=198.19.128.0/17 --profiling=false
