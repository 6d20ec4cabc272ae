#!/bin/sh
# Rendered by bcm for prod: Kueue as a daemon on the control-plane node, with bcm's certificates.
exec /usr/local/lib/bcm-k8s/bin/kueue --config=/etc/bcm-k8s/kueue/config.yaml --kubeconfig=/etc/bcm-k8s/kueue.kubeconfig
