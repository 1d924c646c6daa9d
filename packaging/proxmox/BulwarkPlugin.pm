package PVE::Storage::Custom::BulwarkPlugin;

# A Proxmox VE storage plugin for bulwark: VM disks as bulwark volumes (encrypted,
# checksummed, copy-on-write), served to QEMU over the pool's NBD unix socket.
#
# Every method is one or a few `bulwark` commands, as docs/integrations.md maps them;
# the plugin keeps no state of its own but one key file per volume. Names:
# - `vm-<vmid>-disk-<n>`: a volume of that name.
# - `base-<vmid>-disk-<n>` (a template's disk): bulwark renames nothing, so it is the
#   volume `vm-<vmid>-disk-<n>`'s snapshot `__base__`, held (`pve-base`) so it cannot go
#   while linked clones need it, and the volume is set readonly=on.
# - `base-<vmid>-disk-<n>/vm-<id>-disk-<m>` (a linked clone): the volume
#   `vm-<id>-disk-<m>`, a bulwark clone of `vm-<vmid>-disk-<n>@__base__` under its own key.
# Keys: `<keydir>/<volume>.key`, 32 random bytes made at alloc or clone (mode 0600 in a
# 0700 directory); `activate_volume` loads a locked volume's key from it. A secret never
# goes on a command line: bulwark reads the file itself.

use strict;
use warnings;

use Fcntl qw(O_WRONLY O_CREAT O_EXCL);
use IPC::Open3;
use JSON;
use Symbol qw(gensym);

use base qw(PVE::Storage::Plugin);

my $BASE_SNAP = '__base__';
my $BASE_HOLD = 'pve-base';

# The API versions this plugin was written against: 10 (volume_snapshot_info) to 12
# (qemu_blockdev_options). It answers the node's own version when that is among them.
sub api {
    my $node = eval { PVE::Storage::APIVER() };
    return $node if defined($node) && $node >= 10 && $node <= 12;
    return 12;
}

sub type { return 'bulwark'; }

sub plugindata {
    return {
        content => [ { images => 1 }, { images => 1 } ],
        format => [ { raw => 1 }, 'raw' ],
    };
}

sub properties {
    return {
        'bulwark-dir' => {
            description => "The bulwark pool's directory (its daemon must run on this node).",
            type => 'string',
        },
        'bulwark-keydir' => {
            description => "Directory of the volumes' key files (default: <bulwark-dir>/pve-keys).",
            type => 'string',
            optional => 1,
        },
        'bulwark-encryption' => {
            description => "Create volumes encrypted (default 1).",
            type => 'boolean',
            optional => 1,
        },
        'bulwark-binary' => {
            description => "The bulwark binary (default: bulwark in PATH).",
            type => 'string',
            optional => 1,
        },
    };
}

sub options {
    return {
        'bulwark-dir' => { fixed => 1 },
        'bulwark-keydir' => { optional => 1 },
        'bulwark-encryption' => { optional => 1 },
        'bulwark-binary' => { optional => 1 },
        nodes => { optional => 1 },
        disable => { optional => 1 },
        content => { optional => 1 },
    };
}

# --- commands ---------------------------------------------------------------

sub pool_dir {
    my ($scfg) = @_;
    my $dir = $scfg->{'bulwark-dir'} or die "bulwark storage: 'bulwark-dir' is not set\n";
    return $dir;
}

sub socket_path { return pool_dir($_[0]) . '/nbd.sock'; }

sub key_dir {
    my ($scfg) = @_;
    return $scfg->{'bulwark-keydir'} // pool_dir($scfg) . '/pve-keys';
}

sub key_file { my ($scfg, $volume) = @_; return key_dir($scfg) . "/$volume.key"; }

sub encrypted { my ($scfg) = @_; return $scfg->{'bulwark-encryption'} // 1; }

# Runs `bulwark --pool DIR ARGS...`; returns its stdout. Dies with bulwark's own error
# line (bulwark prints one `error: ...` line and exits 1 or 2).
sub bulwark {
    my ($scfg, @args) = @_;
    my @cmd = ($scfg->{'bulwark-binary'} // 'bulwark', '--pool', pool_dir($scfg), @args);
    my $err = gensym;
    my $pid = open3(my $in, my $out, $err, @cmd);
    close($in);
    my $stdout = do { local $/; <$out> } // '';
    my $stderr = do { local $/; <$err> } // '';
    waitpid($pid, 0);
    my $rc = $? >> 8;
    if ($? != 0) {
        my @lines = grep { /\S/ } split(/\n/, $stderr);
        my ($line) = (grep({ /^error:/ } @lines), @lines, "exit status $rc");
        $line =~ s/^error:\s*//;
        die "bulwark $args[0] $args[1]: $line\n" if @args > 1;
        die "bulwark $args[0]: $line\n";
    }
    return $stdout;
}

sub bulwark_json { my ($scfg, @args) = @_; return decode_json(bulwark($scfg, @args, '--json')); }

sub volumes {
    my ($scfg) = @_;
    return { map { $_->{name} => $_ } @{ bulwark_json($scfg, 'volume', 'list') } };
}

sub snapshots {
    my ($scfg, $volume) = @_;
    return bulwark_json($scfg, 'snapshot', 'list', $volume);
}

# A new key file for `$volume`: 32 random bytes, mode 0600, never overwriting one.
sub make_key {
    my ($scfg, $volume) = @_;
    my $dir = key_dir($scfg);
    if (!-d $dir) {
        mkdir($dir, 0700) or die "cannot create key directory $dir: $!\n";
    }
    chmod(0700, $dir);
    my $path = key_file($scfg, $volume);
    open(my $rnd, '<:raw', '/dev/urandom') or die "/dev/urandom: $!\n";
    my $got = read($rnd, my $key, 32);
    close($rnd);
    die "short read from /dev/urandom\n" if !defined($got) || $got != 32;
    sysopen(my $fh, $path, O_WRONLY | O_CREAT | O_EXCL, 0600)
        or die "cannot create key file $path: $!\n";
    binmode($fh);
    print $fh $key or die "writing $path: $!\n";
    close($fh) or die "writing $path: $!\n";
    return $path;
}

sub secret_args {
    my ($scfg, $volume, $new) = @_;
    return ('--encryption', 'off') if !encrypted($scfg) && $new;
    return () if !encrypted($scfg);
    my $path = $new ? make_key($scfg, $volume) : key_file($scfg, $volume);
    return ('--key-file', $path);
}

# --- names ------------------------------------------------------------------

# PVE's name → (the bulwark volume, its snapshot for a template's disk or undef).
sub bulwark_name {
    my ($volname) = @_;
    my ($vtype, $name, $vmid, $basename, $basevmid, $isBase) = __PACKAGE__->parse_volname($volname);
    if ($isBase) {
        (my $volume = $name) =~ s/^base-/vm-/;
        return ($volume, $BASE_SNAP);
    }
    return ($name, undef);
}

sub parse_volname {
    my ($class, $volname) = @_;
    if ($volname =~ m!^((base-(\d+)-\S+)/)?((base|vm)-(\d+)-[A-Za-z0-9][A-Za-z0-9._-]*)$!) {
        my ($basename, $basevmid, $name, $kind, $vmid) = ($2, $3, $4, $5, $6);
        die "bulwark: name '$name' is longer than bulwark's 64 characters\n" if length($name) > 64;
        return ('images', $name, $vmid, $basename, $basevmid, $kind eq 'base', 'raw');
    }
    die "unable to parse bulwark volume name '$volname'\n";
}

sub export_name {
    my ($volname, $snapname) = @_;
    my ($volume, $snap) = bulwark_name($volname);
    $snap = $snapname if defined $snapname;
    return defined($snap) ? "$volume\@$snap" : $volume;
}

sub filesystem_path {
    my ($class, $scfg, $volname, $snapname) = @_;
    my ($vtype, undef, $vmid) = $class->parse_volname($volname);
    my $path = 'nbd+unix:///' . export_name($volname, $snapname) . '?socket=' . socket_path($scfg);
    return wantarray ? ($path, $vmid, $vtype) : $path;
}

sub path {
    my ($class, $scfg, $volname, $storeid, $snapname) = @_;
    return $class->filesystem_path($scfg, $volname, $snapname);
}

# PVE 9 starts QEMU with -blockdev: the NBD driver on the pool's unix socket. A daemon
# restart then costs the guest no I/O error: requests wait up to reconnect-delay seconds.
sub qemu_blockdev_options {
    my ($class, $scfg, $storeid, $volname, $machine_version, $options) = @_;
    return {
        driver => 'nbd',
        server => { type => 'unix', path => socket_path($scfg) },
        export => export_name($volname, $options->{'snapshot-name'}),
        'reconnect-delay' => 10,
    };
}

# --- storage ----------------------------------------------------------------

sub status {
    my ($class, $storeid, $scfg, $cache) = @_;
    my $st = eval { bulwark_json($scfg, 'status') };
    return (0, 0, 0, 0) if !$st;
    my $space = $st->{space};
    return ($space->{total_bytes}, $space->{free_bytes}, $space->{used_bytes}, 1);
}

sub activate_storage {
    my ($class, $storeid, $scfg, $cache) = @_;
    eval { bulwark($scfg, 'status') };
    die "bulwark storage '$storeid': the daemon of " . pool_dir($scfg)
        . " does not answer (start it: systemctl start bulwark\@...): $@" if $@;
    return 1;
}

sub deactivate_storage { return 1; }

sub check_connection {
    my ($class, $storeid, $scfg) = @_;
    return eval { bulwark($scfg, 'status'); 1 } ? 1 : 0;
}

# --- images -----------------------------------------------------------------

sub free_name {
    my ($vols, $vmid) = @_;
    for my $n (0 .. 999) {
        my $name = "vm-$vmid-disk-$n";
        (my $base = $name) =~ s/^vm-/base-/;
        return $name if !$vols->{$name} && !$vols->{$base};
    }
    die "no free disk name for VM $vmid\n";
}

sub alloc_image {
    my ($class, $storeid, $scfg, $vmid, $fmt, $name, $size_kib) = @_;
    die "bulwark storage: format '$fmt' is not supported (raw only)\n" if $fmt ne 'raw';
    my $vols = volumes($scfg);
    if (defined $name) {
        die "illegal name '$name' - should be 'vm-$vmid-*'\n" if $name !~ m/^vm-\Q$vmid\E-/;
        die "volume '$name' already exists\n" if $vols->{$name};
    } else {
        $name = free_name($vols, $vmid);
    }
    my $bytes = round_up($size_kib * 1024);
    my @secret = secret_args($scfg, $name, 1);
    eval { bulwark($scfg, 'volume', 'create', $name, '--size', $bytes, @secret) };
    if (my $err = $@) {
        unlink(key_file($scfg, $name)) if encrypted($scfg);
        die $err;
    }
    return $name;
}

sub round_up {
    my ($bytes) = @_;
    my $block = 4096;
    $bytes = $block if $bytes < $block;
    return int(($bytes + $block - 1) / $block) * $block;
}

sub free_image {
    my ($class, $storeid, $scfg, $volname, $isBase, $format) = @_;
    my ($volume, $snap) = bulwark_name($volname);
    if (defined $snap) {
        # A template's disk: its hold goes first (linked clones still refuse the destroy).
        eval { bulwark($scfg, 'snapshot', 'release', "$volume\@$snap", $BASE_HOLD) };
        warn $@ if $@ && $@ !~ /not held|does not exist/;
    }
    eval { bulwark($scfg, 'volume', 'destroy', '-r', $volume) };
    if (my $err = $@) {
        eval { bulwark($scfg, 'snapshot', 'hold', "$volume\@$snap", $BASE_HOLD) } if defined $snap;
        die $err;
    }
    unlink(key_file($scfg, $volume));
    return undef;
}

sub list_images {
    my ($class, $storeid, $scfg, $vmid, $vollist, $cache) = @_;
    my $vols = volumes($scfg);
    my @out;
    for my $v (sort { $a->{name} cmp $b->{name} } values %$vols) {
        next if $v->{name} !~ m/^vm-(\d+)-/;
        my $owner = $1;
        my $volname = $v->{name};
        my $parent;
        if (defined(my $origin = $v->{origin})) {
            if ($origin =~ m/^(vm-\d+-\S+)\@\Q$BASE_SNAP\E$/) {
                ($parent = $1) =~ s/^vm-/base-/;
                $volname = "$parent/$volname";
            }
        }
        if (grep { $_->{snapshot} eq $BASE_SNAP } @{ snapshots($scfg, $v->{name}) }) {
            ($volname = $v->{name}) =~ s/^vm-/base-/;
            $parent = undef;
        }
        my $volid = "$storeid:$volname";
        if ($vollist) {
            next if !grep { $_ eq $volid } @$vollist;
        } elsif (defined $vmid) {
            next if $owner ne $vmid;
        }
        push @out, {
            volid => $volid,
            format => 'raw',
            size => $v->{size_bytes},
            used => $v->{used_bytes},
            vmid => $owner,
            defined($parent) ? (parent => $parent) : (),
        };
    }
    return \@out;
}

sub volume_info {
    my ($scfg, $volname) = @_;
    my ($volume) = bulwark_name($volname);
    my $v = volumes($scfg)->{$volume} or die "bulwark volume '$volume' does not exist\n";
    return $v;
}

sub volume_size_info {
    my ($class, $scfg, $storeid, $volname, $timeout) = @_;
    my $v = volume_info($scfg, $volname);
    my $size = $v->{size_bytes};
    my (undef, undef, undef, $basename) = $class->parse_volname($volname);
    return wantarray ? ($size, 'raw', $v->{used_bytes}, $basename) : $size;
}

sub volume_resize {
    my ($class, $scfg, $storeid, $volname, $size, $running) = @_;
    my ($volume, $snap) = bulwark_name($volname);
    die "a template's disk is not resized\n" if defined $snap;
    my $bytes = round_up($size);
    bulwark($scfg, 'volume', 'resize', $volume, $bytes);
    return $bytes;
}

# --- activation and keys ----------------------------------------------------

sub activate_volume {
    my ($class, $storeid, $scfg, $volname, $snapname, $cache) = @_;
    my ($volume) = bulwark_name($volname);
    my $v = volume_info($scfg, $volname);
    if (($v->{key_status} // '') eq 'unavailable') {
        my $key = key_file($scfg, $volume);
        die "bulwark volume '$volume' is locked and its key file $key is missing\n" if !-e $key;
        bulwark($scfg, 'key', 'load', $volume, '--key-file', $key);
    }
    return 1;
}

# Nothing to undo: the key stays loaded (unloading is refused while a client is attached,
# and other volumes of the same VM may share a daemon restart's key load).
sub deactivate_volume { return 1; }

sub map_volume { die "bulwark storage: containers (map_volume) are not supported\n"; }

# --- snapshots --------------------------------------------------------------

sub volume_qemu_snapshot_method { return 'storage'; }

sub plain_volume {
    my ($volname) = @_;
    my ($volume, $snap) = bulwark_name($volname);
    die "a template's disk has no snapshots of its own\n" if defined $snap;
    return $volume;
}

sub volume_snapshot {
    my ($class, $scfg, $storeid, $volname, $snap) = @_;
    bulwark($scfg, 'snapshot', 'create', plain_volume($volname) . "\@$snap");
    return undef;
}

sub volume_snapshot_delete {
    my ($class, $scfg, $storeid, $volname, $snap, $running) = @_;
    bulwark($scfg, 'snapshot', 'destroy', plain_volume($volname) . "\@$snap");
    return undef;
}

sub volume_rollback_is_possible {
    my ($class, $scfg, $storeid, $volname, $snap, $blockers) = @_;
    my $volume = plain_volume($volname);
    my @names = map { $_->{snapshot} } @{ snapshots($scfg, $volume) };
    my ($at) = grep { $names[$_] eq $snap } 0 .. $#names;
    die "snapshot '$snap' does not exist\n" if !defined $at;
    my @newer = @names[ $at + 1 .. $#names ];
    return 1 if !@newer;
    push @$blockers, @newer if $blockers;
    die "can't rollback, '$snap' is not the most recent snapshot of '$volume' (newer: "
        . join(', ', @newer) . ")\n";
}

sub volume_snapshot_rollback {
    my ($class, $scfg, $storeid, $volname, $snap) = @_;
    bulwark($scfg, 'volume', 'rollback', plain_volume($volname) . "\@$snap");
    return undef;
}

sub volume_snapshot_info {
    my ($class, $scfg, $storeid, $volname) = @_;
    my $volume = plain_volume($volname);
    my %info;
    my $id = 0;
    for my $s (@{ snapshots($scfg, $volume) }) {
        $info{ $s->{snapshot} } = { id => $id++, timestamp => $s->{created} };
    }
    return \%info;
}

# --- templates and clones ---------------------------------------------------

sub create_base {
    my ($class, $storeid, $scfg, $volname) = @_;
    my ($vtype, $name, $vmid, undef, undef, $isBase) = $class->parse_volname($volname);
    die "create_base: '$volname' is already a template's disk\n" if $isBase;
    die "create_base: '$volname' is a linked clone; clone it in full first\n"
        if $volname =~ m!/!;
    my @snaps = grep { $_->{snapshot} ne $BASE_SNAP } @{ snapshots($scfg, $name) };
    die "create_base: '$name' has snapshots (" . join(', ', map { $_->{snapshot} } @snaps)
        . "); delete them first\n" if @snaps;
    bulwark($scfg, 'snapshot', 'create', "$name\@$BASE_SNAP");
    bulwark($scfg, 'snapshot', 'hold', "$name\@$BASE_SNAP", $BASE_HOLD);
    bulwark($scfg, 'volume', 'set', $name, 'readonly=on');
    (my $base = $name) =~ s/^vm-/base-/;
    return $base;
}

sub clone_image {
    my ($class, $scfg, $storeid, $volname, $vmid, $snap) = @_;
    my ($vtype, $basename, $basevmid, undef, undef, $isBase) = $class->parse_volname($volname);
    die "clone_image: only a template's disk is cloned (not '$volname')\n" if !$isBase;
    my ($volume, $base_snap) = bulwark_name($volname);
    my $name = free_name(volumes($scfg), $vmid);
    my @secret = encrypted($scfg) ? ('--key-file', make_key($scfg, $name)) : ();
    eval { bulwark($scfg, 'volume', 'clone', "$volume\@$base_snap", $name, @secret) };
    if (my $err = $@) {
        unlink(key_file($scfg, $name)) if @secret;
        die $err;
    }
    return "$basename/$name";
}

sub volume_has_feature {
    my ($class, $scfg, $feature, $storeid, $volname, $snapname, $running, $opts) = @_;
    my (undef, undef, undef, undef, undef, $isBase) = $class->parse_volname($volname);
    my $key = defined($snapname) ? 'snap' : $isBase ? 'base' : 'current';
    my $features = {
        snapshot => { current => 1, snap => 1 },
        clone => { base => 1 },
        template => { current => 1 },
        copy => { current => 1, base => 1, snap => 1 },
        sparseinit => { base => 1, current => 1 },
    };
    return 1 if $features->{$feature} && $features->{$feature}->{$key};
    return undef;
}

sub rename_volume { die "bulwark storage: volumes cannot be renamed\n"; }

1;
