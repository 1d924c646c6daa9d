package PVE::Storage::Plugin;

# A stand-in for Proxmox VE's storage plugin base class, for tests/test_proxmox_plugin.py.
#
# Why a stand-in: PVE's own PVE::Storage::Plugin pulls in PVE::Tools, PVE::JSONSchema,
# PVE::Cluster and the cluster file system (/etc/pve), which exist only on a PVE node.
# What it stands for: the base class a custom plugin derives from. The bulwark plugin
# overrides every method PVE calls on an `images` storage and calls nothing of the base
# class, so the stand-in only has to exist (`use base` needs the package) and provide
# the constructor-less class methods PVE itself would dispatch through. It deliberately
# defines no method the plugin could fall back on by mistake: a method the plugin lacks
# fails the test ("Can't locate object method") instead of running PVE code we did not
# load.

use strict;
use warnings;

1;
