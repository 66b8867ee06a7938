#!/bin/sh
# ckptd mirror-config for tor (Linux bridge, tc mirred), 3 session(s): 3 link(s) per ring, every chunk on >= 2 stream(s)
#   ckptd_cap0_rx: rank 0 RX -> cap0; links 0>1 (ch0), 0>2 (ch1)
#   ckptd_cap1_rx: rank 1 RX -> cap1; links 1>2 (ch0), 1>3 (ch1)
#   ckptd_cap2_rx: rank 2 RX -> cap2; links 2>3 (ch0), 2>4 (ch1)
set -e
ip netns exec lab-sw tc qdisc add dev Ethernet0 clsact
ip netns exec lab-sw tc filter add dev Ethernet0 ingress protocol all u32 match u32 0 0 action mirred egress mirror dev Ethernet32
ip netns exec lab-sw tc qdisc add dev Ethernet4 clsact
ip netns exec lab-sw tc filter add dev Ethernet4 ingress protocol all u32 match u32 0 0 action mirred egress mirror dev Ethernet36
ip netns exec lab-sw tc qdisc add dev Ethernet8 clsact
ip netns exec lab-sw tc filter add dev Ethernet8 ingress protocol all u32 match u32 0 0 action mirred egress mirror dev Ethernet40
